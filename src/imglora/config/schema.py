"""The configuration's shape: frozen dataclasses, one per preset section, each field with its help.

Every field carries its help text, range and choices in its metadata (``setting(...)``); the
validator and ``imglora config --keys`` read them from there, so a field is declared in exactly one
place. ``resume_safe=True`` marks what may differ on ``--resume`` (it does not change what is
trained: logging, checkpoint frequency, where files go); ``moved_from`` names the key a field had in
an older schema, for the migration.

Sections here are shared by every family. A family's own keys live in its own section (``[name]``,
declared in ``families/<name>/config.py`` with the same ``setting`` helper), so a key meant for
another family is an error, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from .toml_io import dumps_toml

SCHEMA_VERSION = 2
REQUIRED = dataclasses.MISSING


def setting(default: Any = REQUIRED, help: str = "", *, min: float | None = None, max: float | None = None,
            min_exclusive: bool = False, resume_safe: bool = False, moved_from: str | None = None,
            inherit: bool = False) -> Any:
    """A config field: its default, help text, numeric range, resume safety and former key.
    ``inherit`` (a list of tables): each table takes the keys it leaves out from the enclosing one."""
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive, "resume_safe": resume_safe,
            "moved_from": moved_from, "inherit": inherit}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda d=tuple(default.items()): dict(d), metadata=meta)
    if default is REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


DType = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class ModelConfig:
    family: str = setting(help="Model family; `imglora config --keys` lists the installed ones.")
    path: str = setting(help="A local diffusers/transformers folder, a hub id already in the local Hugging Face "
                             "cache, tiny:<family> (a tiny random model built offline), or, where the family "
                             "supports it, the model's single .safetensors file (as Civitai and ComfyUI users "
                             "have it).")
    dtype: DType = setting("bf16", help="Precision of the frozen base weights on a GPU (fp32 on CPU).")
    vae: str = setting("", help="With a single-file model: a VAE file, used instead of the model's own or where "
                                "the model file has none.")
    text_encoder: str = setting("", help="With a single-file model whose text encoders are files of their own: "
                                         "the first one's file (e.g. clip_l.safetensors).")
    text_encoder_2: str = setting("", help="With a single-file model whose text encoders are files of their own: "
                                           "the second one's file (e.g. t5xxl_fp16.safetensors).")
    config: str = setting("", help="With a single-file model: a diffusers folder or cached hub id whose configs and "
                                   "tokenizers describe the architecture; empty = the configs imglora ships for "
                                   "the real models, tokenizers from the Hugging Face cache or model.comfyui.")
    comfyui: str = setting("", help="A ComfyUI folder: the model files above may then be bare names, looked up "
                                    "in its model folders and extra_model_paths.yaml as ComfyUI does.")


@dataclass(frozen=True)
class DataSetConfig:
    """One dataset: a folder of images and how its images and captions are read.

    ``[data]`` is itself one set (the single-set shorthand every older preset uses); each
    ``[[data.sets]]`` table is another, and takes every key it does not set from ``[data]``, as
    kohya's subsets take theirs from ``[general]``. ``DataConfig`` extends these fields with the
    run-wide ones (fields shared, no behaviour)."""

    # Names users bring from kohya sd-scripts and ai-toolkit: an unknown key says imglora's name.
    other_names: ClassVar[dict[str, str]] = {
        "image_dir": "dir", "folder_path": "dir", "num_repeats": "repeats", "caption_extension": "caption_ext",
        "class_tokens": "class_caption", "is_reg": "regularization", "flip_aug": "flip",
        "random_crop": "crop (\"random\")", "caption_dropout_rate": "caption_dropout",
        "shuffle_caption": "shuffle_tags", "shuffle_tokens": "shuffle_tags", "caption_tag_dropout_rate": "tag_dropout",
        "token_dropout_rate": "tag_dropout", "conditioning_data_dir": "mask_dir", "mask_path": "mask_dir",
        "control_path": "control_dir", "control_directory": "control_dir", "conditioning_dir": "control_dir",
    }

    name: str = setting("", help="The set's name in messages and the run record; empty = its folder's name.",
                        resume_safe=True)
    dir: str = setting("", help="Image folder with same-name .txt captions; N_name subfolders repeat N times.",
                       resume_safe=True)
    repeats: int = setting(1, help="Repeats per epoch of the images directly in dir (kohya's num_repeats).", min=1,
                           max=10000)
    resolution: int = setting(1024, help="Target side length; buckets keep the area close to resolution². Sets "
                                         "may differ (multi-resolution training, as ai-toolkit's).",
                              min=64, max=4096)
    caption_ext: str = setting(".txt", help="Extension of caption files beside the images (kohya's "
                                            "caption_extension).")
    missing_caption: Literal["error", "default"] = setting(
        "error", help="An image without a caption is an error, or gets default_caption.")
    default_caption: str = setting("", help="Caption for images without one when missing_caption = \"default\".")
    trigger_word: str = setting("", help="Prepended to every caption that does not already contain it (never in a "
                                         "regularization set: its images show the class without the subject).")
    crop: Literal["center", "random"] = setting("center", help="Crop to the bucket at the center or at a "
                                                "seeded random offset (fixed per image, so it can be cached).")
    flip: bool = setting(False, help="Also train on horizontally flipped images (both are cached).")
    caption_dropout: float = setting(
        0.0, help="Probability that a step trains an image on the empty caption (kohya's caption_dropout_rate), so "
                  "the LoRA also acts without its prompt, as classifier-free guidance expects. The empty caption "
                  "is one more cached text entry.", min=0.0, max=1.0)
    shuffle_tags: bool = setting(False, help="Shuffle the comma-separated tags of each caption after the first "
                                             "keep_tokens (kohya's shuffle_caption); each step draws one of "
                                             "shuffle_variants cached permutations.")
    keep_tokens: int = setting(0, help="Tags at the start of a caption that shuffle_tags and tag_dropout leave in "
                                       "place (kohya's keep_tokens); the trigger word is the first tag.",
                               min=0, max=1000)
    tag_dropout: float = setting(0.0, help="Probability of leaving out each tag after keep_tokens (kohya's "
                                           "caption_tag_dropout_rate), drawn into the cached variants.",
                                 min=0.0, max=1.0)
    shuffle_variants: int = setting(8, help="With shuffle_tags or tag_dropout: cached variants per caption, drawn "
                                            "from a seeded generator; a step picks one, so no step runs a text "
                                            "encoder. Each is one text entry in the cache and in memory.",
                                    min=1, max=256)
    regularization: bool = setting(False, help="A prior-preservation set (kohya's is_reg): its images are "
                                               "interleaved with the training images (data.reg_ratio), their loss "
                                               "weighted by data.prior_loss_weight; never held out or evaluated.")
    class_caption: str = setting("", help="Regularization sets: the caption of images without a caption file "
                                          "(kohya's class_tokens), e.g. \"a photo of a toy\".")
    mask_dir: str = setting("", help="Folder of loss masks, one per image with the same file stem (png, jpg, "
                                     "webp): white = train, black = ignore, grey = weight in between. Each is "
                                     "resized and cropped with its image and cached with its latents; the loss "
                                     "is weighted per latent pixel. Empty = no masks.", resume_safe=True)
    alpha_mask: bool = setting(False, help="Use each image's alpha channel as its loss mask (transparent = ignore, "
                                           "opaque = train), as kohya's alpha_mask.")
    control_dir: str = setting("", help="Edit-model families: the folder of source (control) images, one per "
                                        "training image with its file stem (<stem>_1, <stem>_2, ... for more where the "
                                        "family takes several); each is fitted to its target's bucket and cached "
                                        "with its latents. Empty = none.", resume_safe=True)


@dataclass(frozen=True)
class DataConfig(DataSetConfig):
    buckets: bool = setting(True, help="Aspect-ratio buckets; false crops every image to a square.")
    bucket_step: int = setting(0, help="Bucket sides are multiples of this; 0 = the family's.", min=0, max=512)
    min_bucket_side: int = setting(256, help="Smallest bucket side.", min=16, max=8192)
    max_bucket_side: int = setting(2048, help="Largest bucket side.", min=16, max=8192)
    skip_bad_images: bool = setting(False, help="Skip unreadable images with a warning instead of failing.")
    prior_loss_weight: float = setting(1.0, help="Loss weight of regularization images (kohya's "
                                                 "prior_loss_weight).", min=0.0, max=100.0)
    reg_ratio: float = setting(1.0, help="Regularization images per training image in each epoch (repeats "
                                         "counted): 1 = one each, as kohya interleaves them.", min=0.0, max=100.0,
                               min_exclusive=True)
    sets: list[DataSetConfig] = setting(
        [], help="Several datasets in one run: [[data.sets]] tables, each taking the per-set keys (name, dir, "
                 "repeats, resolution, caption_ext, ..., alpha_mask) and every one it leaves out from [data]. "
                 "Empty = [data] is the one set.", inherit=True)

    @property
    def all_sets(self) -> tuple[DataSetConfig, ...]:
        """The sets of the run: ``sets``, or ``[data]`` itself as the one set."""
        if self.sets:
            return tuple(self.sets)
        return (DataSetConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DataSetConfig)}),)

    @property
    def max_resolution(self) -> int:
        return max(s.resolution for s in self.all_sets)

    def first_training_set(self) -> DataSetConfig:
        return next((s for s in self.all_sets if not s.regularization), self.all_sets[0])


@dataclass(frozen=True)
class CacheConfig:
    dir: str = setting(".imglora/cache", help="Where latents and text-encoder outputs are cached.", resume_safe=True)
    encoder_dtype: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto", help="Precision of the VAE and text encoders while caching; auto = bf16 on CUDA, fp32 on CPU.")
    text_max_length: int = setting(0, help="Token length of cached text embeddings; 0 = the family's default.",
                                   min=0, max=4096)
    latents: Literal["sample", "mean"] = setting(
        "sample", help="What training sees of the VAE's posterior: sample (a fresh draw every time an image is used, "
                       "from the mean and standard deviation cached together, as diffusers' training scripts draw "
                       "it; kohya draws once at caching) or mean (the posterior's mean, the same latents every time). "
                       "Keys the latent entries.")
    quantized_base: bool = setting(
        True, help="With memory.fp8 and a base model given as a file: keep the quantized model in dir/quantized "
                   "(about 12 GB for a 12B transformer), so later runs skip reading and quantizing the full-precision weights.",
        resume_safe=True)


AdapterType = Literal["lora", "dora", "loha", "lokr", "oft"]


@dataclass(frozen=True)
class LoraConfig:
    type: AdapterType = setting(
        "lora", help="Adapter type, all through peft: lora; dora (LoRA plus a trained magnitude per output row, "
                     "weight-decomposed); loha (LyCORIS LoHa: Hadamard product of two low-rank pairs); lokr "
                     "(LyCORIS LoKr: Kronecker product of two factors); oft (orthogonal finetuning: each block of "
                     "lora.rank output features rotated, as ComfyUI's and LyCORIS' OFT). README: where each one loads.")
    rank: int = setting(16, help="Adapter rank (dimension): LoRA/DoRA rank, LoHa's rank of each pair, LoKr's rank "
                                 "of its low-rank factor(s); OFT's block size (as LyCORIS reads dim for OFT), which "
                                 "must divide every adapted layer's output features.", min=1, max=1024)
    alpha: float = setting(0.0, help="Adapter alpha; the update is scaled by alpha / rank. 0 = equal to rank.",
                           min=0.0, max=65536.0)
    dropout: float = setting(0.0, help="LoRA/DoRA: dropout on the adapter's input.", min=0.0, max=0.99)
    loraplus_lr_ratio: float = setting(0.0, help="LoRA/DoRA: LoRA+ (kohya's and musubi-tuner's loraplus_lr_ratio): "
                                                 "the B (up) matrices learn at this multiple of the learning rate "
                                                 "(16 is common); 0 = off.", min=0.0, max=1000.0)
    targets: list[str] = setting([], help="Module names to adapt (peft target_modules); empty = the family's defaults.")
    blocks: list[str] = setting(
        [], help="The blocks that get the adapter (kohya's train_double_block_indices / train_single_block_indices), "
                 "as <kind>, <kind>:<index> or <kind>:<first>-<last> with the block kinds of the model's family "
                 "(README, Methods: double, single; down, mid, up; block); empty = every block.")
    block_ranks: dict[str, int] = setting(
        {}, help="Rank per block selector, e.g. {\"double:0-9\" = 32} (kohya's block_dims); other blocks: lora.rank.")
    block_alphas: dict[str, float] = setting(
        {}, help="Alpha per block selector (kohya's block_alphas); other blocks: lora.alpha.")
    block_lr: dict[str, float] = setting(
        {}, help="Learning-rate multiplier per block selector (kohya's down_lr_weight / mid_lr_weight / up_lr_weight), "
                 "e.g. {\"single\" = 0.5}; with LoRA+ the B matrices' ratio applies on top.")
    conv_rank: int = setting(0, help="Rank of the adapted Conv2d layers (LyCORIS conv_dim); 0 = lora.rank.",
                             min=0, max=1024)
    conv_alpha: float = setting(0.0, help="Alpha of the adapted Conv2d layers (LyCORIS conv_alpha); 0 = lora.alpha "
                                          "if conv_rank is 0, else conv_rank.", min=0.0, max=65536.0)
    effective_conv2d: bool = setting(
        False, help="LoHa/LoKr on k×k Conv2d layers: the CP (Tucker) form of LyCORIS use_tucker / peft "
                    "use_effective_conv2d, with a small core per kernel position; false = the flat form.")
    factor: int = setting(-1, help="LoKr: the Kronecker factor (LyCORIS factor, peft decompose_factor); -1 = as "
                                   "close to the square root of each dimension as divides it.", min=-1, max=65536)
    decompose_both: bool = setting(False, help="LoKr: make the first (small) Kronecker factor low-rank too.")
    rank_dropout: float = setting(0.0, help="LoHa/LoKr: dropout of whole rank components while training.",
                                  min=0.0, max=0.99)
    module_dropout: float = setting(0.0, help="LoHa/LoKr: probability of skipping a module's update in a forward.",
                                    min=0.0, max=0.99)
    text_encoder: bool = setting(
        False, help="The adapter on the model's CLIP text encoders too (all of them; a T5 encoder stays frozen), "
                    "with train.text_encoder_lr. Their outputs can then no longer be cached: each update encodes "
                    "its captions' tokens (cached outputs of frozen encoders still are).")


@dataclass(frozen=True)
class BudgetConfig:
    max_cost: float = setting(0.0, help="Stop (with a checkpoint) when the projected session cost exceeds this; "
                                        "0 = no limit. Needs hourly_rate.", min=0.0, max=1e9, resume_safe=True)
    hourly_rate: float = setting(0.0, help="What the machine costs per hour, in your currency.", min=0.0, max=1e6,
                                 resume_safe=True)
    max_hours: float = setting(0.0, help="Stop (with a checkpoint) when the projected session exceeds this many "
                                         "hours; 0 = no limit.", min=0.0, max=1e6, resume_safe=True)
    smoke_steps: int = setting(20, help="Measured updates (after warm-up) before the session is projected.",
                               min=1, max=100_000, resume_safe=True)
    currency: str = setting("USD", help="Shown with costs.", resume_safe=True)


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = setting(0, help="Optimizer updates to run; 0 = use epochs.", min=0, max=10_000_000)
    process_timeout: int = setting(600, help="With several processes (accelerate launch, --gpus N): seconds a "
                                             "process waits for the others in a collective before the run stops "
                                             "with an error (a process that died must not leave the rest hanging).",
                                   min=10, max=86_400, resume_safe=True)
    epochs: int = setting(0, help="Passes over the dataset (with repeats), used when max_steps = 0.",
                          min=0, max=100_000)
    learning_rate: float = setting(1e-4, help="Peak learning rate.", min=0.0, max=1.0, min_exclusive=True)
    text_encoder_lr: float = setting(0.0, help="Peak learning rate of the text encoders' adapter (lora.text_encoder); "
                                               "0 = learning_rate.", min=0.0, max=1.0)
    optimizer: str = setting(
        "adamw", help="adamw (torch), adafactor (transformers), adamw8bit, paged_adamw8bit, lion8bit (bitsandbytes), "
                      "prodigy (prodigyopt: learning_rate 1.0), schedulefree_adamw (schedulefree), any torch.optim "
                      "class (SGD, RAdam, ...), or a dotted path to a torch.optim.Optimizer subclass in torch, "
                      "bitsandbytes, prodigyopt, schedulefree or transformers.optimization (any other module: "
                      "train.optimizer_allow_any).")
    optimizer_allow_any: bool = setting(
        False, help="Let train.optimizer be a dotted path into any installed module (your own optimizer). Checking "
                    "the config then imports that module, which runs its code: set it only for code you trust. "
                    "The name must still be a torch.optim.Optimizer subclass.", resume_safe=True)
    optimizer_args: dict[str, Any] = setting(
        {}, help="Keyword arguments for the optimizer, passed through as given and overriding adam_*/weight_decay, "
                 "e.g. {d_coef = 2, safeguard_warmup = true} for prodigy.")
    weight_decay: float = setting(0.01, help="Decoupled weight decay.", min=0.0, max=1.0)
    adam_beta1: float = setting(0.9, help="AdamW beta1.", min=0.0, max=0.99999)
    adam_beta2: float = setting(0.999, help="AdamW beta2.", min=0.0, max=0.99999)
    adam_eps: float = setting(1e-8, help="AdamW epsilon.", min=0.0, max=1.0, min_exclusive=True)
    scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = setting(
        "constant", help="Learning-rate schedule after the linear warmup (diffusers' get_scheduler, as kohya "
                         "sd-scripts): constant, linear or cosine decay to 0, cosine_with_restarts, polynomial.")
    scheduler_cycles: int = setting(1, help="cosine_with_restarts: number of hard restarts.", min=1, max=10_000)
    scheduler_power: float = setting(1.0, help="polynomial: decay power (1 = linear), down to 1e-7.", min=0.0,
                                     max=100.0, min_exclusive=True)
    warmup_steps: int = setting(0, help="Linear warmup, in optimizer updates.", min=0, max=10_000_000)
    batch_size: int = setting(1, help="Images per micro-batch.", min=1, max=1024)
    grad_accum: int = setting(1, help="Micro-batches per optimizer update.", min=1, max=1024)
    max_grad_norm: float = setting(1.0, help="Gradient clipping norm; 0 = off.", min=0.0, max=1e6)
    max_skipped_updates: int = setting(3, help="An update whose gradients hold a NaN or Inf is skipped: no optimizer, "
        "schedule or EMA step, so nothing non-finite reaches the weights; the log says so and names the first "
        "non-finite gradient's module. The run stops after this many skipped updates in a row (0: at the first).",
        min=0, max=10_000, resume_safe=True)
    loss_type: Literal["l2", "l1", "huber", "smooth_l1"] = setting(
        "l2", help="The image families' per-element loss (kohya's loss_type): l2 (squared error), l1, huber "
                   "(2c(sqrt(e² + c²) - c): quadratic for small errors e, linear for large) or smooth_l1 "
                   "(2(sqrt(e² + c²) - c)); c per sample from huber_schedule.")
    huber_schedule: Literal["snr", "exponential", "constant"] = setting(
        "snr", help="huber / smooth_l1: c over noise levels, as kohya's: snr = (1 - huber_c)/(1 + σ)² + huber_c "
                    "(σ: noise-to-signal ratio; near 1 at low noise, huber_c at high noise); exponential = "
                    "huber_c^t · huber_scale (t: noise level in [0, 1]); constant = huber_c · huber_scale.")
    huber_c: float = setting(0.1, help="huber / smooth_l1: the threshold c (kohya's huber_c).", min=0.0, max=1.0,
                             min_exclusive=True)
    huber_scale: float = setting(1.0, help="huber / smooth_l1: scale of c in the exponential and constant "
                                           "schedules (kohya's huber_scale).", min=0.0, max=100.0, min_exclusive=True)
    dop_weight: float = setting(
        0.0, help="Differential output preservation (ai-toolkit's diff_output_preservation, kohya's and OneTrainer's "
                  "prior preservation with the base model's own output): for each image, the caption with the "
                  "trigger word replaced by train.dop_class is also denoised, and the adapter's prediction for it "
                  "is pulled towards the base model's (adapter off) with this weight; 0 = off. About 2.25x the "
                  "compute of an update.", min=0.0, max=100.0)
    dop_class: str = setting("", help="train.dop_weight: the class word that replaces the trigger word (\"person\", "
                                      "\"dog\", \"painting style\"): what the model should still draw as before.")
    blank_preservation_weight: float = setting(
        0.0, help="Blank-prompt preservation (ai-toolkit's blank_prompt_preservation): the adapter's prediction for "
                  "the empty caption pulled towards the base model's with this weight, so the adapter stays off "
                  "when nothing asks for it; 0 = off.", min=0.0, max=100.0)
    seed: int = setting(42, help="Seed for data order, noise and LoRA init.", min=0, max=2**32 - 1)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = setting(
        "auto", help="auto = bf16 on CUDA, none on CPU.")
    checkpoint_every: int = setting(0, help="Save a checkpoint every N updates; 0 = only at the end.",
                                    min=0, max=10_000_000, resume_safe=True)
    keep_checkpoints: int = setting(3, help="How many newest checkpoints to keep.", min=1, max=100_000, resume_safe=True)
    log_every: int = setting(10, help="Log loss and timing every N updates (each log is a host-device sync).", min=1,
                             max=100_000, resume_safe=True)
    eval_after: bool = setting(False, help="Run `imglora eval` in a fresh process after training.", resume_safe=True)
    ema: bool = setting(False, help="Also keep an exponential moving average of the adapter weights (saved beside "
                                    "them as adapter_ema/; export and eval choose with --weights ema|raw).")
    ema_decay: float = setting(0.999, help="EMA: ema = decay * ema + (1 - decay) * weights at each EMA update.",
                               min=0.0, max=1.0, min_exclusive=True)
    ema_every: int = setting(1, help="EMA: update it every N optimizer updates.", min=1, max=100_000)
    budget: BudgetConfig = field(default_factory=BudgetConfig, metadata={"help": "Budget guard."})


@dataclass(frozen=True)
class MemoryConfig:
    gradient_checkpointing: bool = setting(True, help="Recompute activations in backward.", resume_safe=True)
    fp8: bool = setting(False, help="Store frozen base weights as float8 (optimum-quanto qfloat8).")
    fp8_fused: bool = setting(False, help="With memory.fp8, dequantizing: one cast of each fp8 weight per use, "
        "its scales on whichever of weight or output is smaller, the bias fused, the autocast dtype honoured, no "
        "input saved for a weight gradient never computed (false: optimum-quanto's matmul). Off until measured on "
        "a GPU.", resume_safe=True)
    fp8_compute: bool = setting(False, help="With memory.fp8: run the frozen layers' matmuls in fp8 "
        "(torch._scaled_mm, per-token input scales, the bias fused) instead of dequantizing each weight for a bf16 "
        "matmul, on GPUs with fp8 tensor cores (compute capability 8.9+; elsewhere the run says so and "
        "dequantizes, fused). The LoRA branch stays in the compute dtype. Off until measured on a GPU.",
        resume_safe=True)
    norms_in_model_dtype: bool = setting(False, help="Under autocast, LayerNorm and GroupNorm read and write the "
        "model dtype (fp32 inside the kernel, as in bf16 inference) instead of returning fp32: the modulation after "
        "them runs in bf16 and the next Linear layers need no cast. Off until measured on a GPU.", resume_safe=True)
    compile: Literal["none", "blocks"] = setting("none", help="\"blocks\": torch.compile each transformer block's "
        "forward (one graph per kind; swap and offload hooks outside). The first update compiles. Works with fp8, "
        "swap, checkpointing and every adapter type. Off until measured on a GPU.", resume_safe=True)
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = setting("default", help="torch.compile's mode "
        "(CUDA graphs are not offered: swap and offload move tensors a captured graph cannot follow).", resume_safe=True)
    attention_kernel: Literal["auto", "flash", "efficient", "cudnn", "math"] = setting("auto", help="PyTorch's "
        "attention kernel for every attention of a step (forward, backward and checkpointing's recompute): auto = "
        "on CUDA flash, then efficient, then math, never cuDNN (NaN gradients from its backward are reported on "
        "H100/H200), elsewhere PyTorch's choice; flash, efficient (memory-efficient), cudnn, or math (the reference: slowest, most memory) "
        "to set a kernel aside that is broken or slow on a GPU and driver stack. A kernel that cannot run here is "
        "refused before the model loads.", resume_safe=True)
    blocks_to_swap: int = setting(0, help="Transformer blocks kept in host memory and streamed to the GPU as they "
        "run; the family maps a count onto its block lists (as kohya sd-scripts counts).", min=0, max=1000,
        resume_safe=True)
    quantization: Literal["none", "auto", "qint4", "nf4"] = setting("none", help="4-bit frozen base weights, where "
        "the family supports it: qint4 (optimum-quanto, any device) or nf4 (bitsandbytes NormalFloat4 with double "
        "quantization, the QLoRA recipe; CUDA); auto: nf4 on a CUDA GPU with bitsandbytes installed, else qint4 "
        "(the run says which, and why).")
    offload_checkpoints: bool = setting(
        False, help="With gradient checkpointing: keep each block's saved inputs in pinned host memory, copied back "
                    "when backward recomputes the block (kohya's cpu_offload_checkpointing; about 1.5 GiB less for a "
                    "12B transformer at 1024 px, one copy each way per block).", resume_safe=True)
    swap_prefetch: int = setting(0, help="Swapped blocks copied ahead of the one running; each needs a device "
                                         "buffer per block shape (slots = swap_prefetch + 1). 0 = auto: 1 ahead, "
                                         "then on a GPU the second update's measured copy and block compute times "
                                         "choose the depth (up to 6) that hides the copies, where the card and "
                                         "memory.vram_budget have room; the log and run record show the choice.",
                                 min=0, max=8, resume_safe=True)
    ema_on_cpu: bool = setting(False, help="With train.ema: keep the moving average in host memory (one "
        "device-to-host copy of the adapter per EMA update) instead of beside the weights.", resume_safe=True)
    vram_budget: float = setting(0.0, help="GiB of GPU memory this run may use; > 0: `imglora train` refuses a "
                                           "setting `imglora plan` predicts not to fit, naming the smallest change "
                                           "that fits. 0 = no check.", min=0.0, max=100_000.0, resume_safe=True)


@dataclass(frozen=True)
class EvalConfig:
    prompts: list[str] = setting([], help="Prompts for the evaluation pass; empty = a few defaults with the "
                                          "trigger word.", resume_safe=True)
    control_images: list[str] = setting([], help="Edit-model families: the source image of each of eval.prompts "
                                                 "(one for all, or one per prompt); empty = the data's own pairs.",
                                         resume_safe=True)
    sample_steps: int = setting(20, help="Sampler steps per evaluation image.", min=1, max=1000, resume_safe=True)
    guidance_scale: float = setting(0.0, help="Guidance at evaluation; 0 = the family's default.", min=0.0,
                                    max=100.0, resume_safe=True)
    seed: int = setting(0, help="Seed of the evaluation images.", min=0, max=2**32 - 1, resume_safe=True)
    holdout: int = setting(0, help="Images held out of training for the held-out loss.", min=0, max=100_000)
    every: int = setting(0, help="Validation loss on the held-out data every N updates during training; 0 = off.",
                         min=0, max=10_000_000, resume_safe=True)
    holdout_dir: str = setting("", help="A folder of captioned images used only for the held-out loss (in addition "
                                        "to eval.holdout); never trained on.")
    strengths: list[float] = setting([0.0, 0.5, 1.0], help="Adapter strengths of the evaluation images; 0 = the base "
                                                           "model (the columns of the contact sheet).", resume_safe=True)
    fp8: Literal["same", "on", "off"] = setting("same", help="FP8 base weights during evaluation; same = as "
                                                             "memory.fp8 in training.", resume_safe=True)
    blocks_to_swap: int = setting(-1, help="Blocks swapped during evaluation (as memory.blocks_to_swap); -1 = as in "
                                           "training.", min=-1, max=1000, resume_safe=True)


@dataclass(frozen=True)
class ExportConfig:
    comfyui_dir: str = setting("", help="ComfyUI folder to export into (models/loras).", resume_safe=True)
    name: str = setting("", help="File name of the export; empty = run.name.", resume_safe=True)
    dtype: DType = setting("bf16", help="Precision of the exported tensors.", resume_safe=True)
    format: str = setting("default", help="Key layout of the export: default, or one the family offers "
                                          "(e.g. kohya).", resume_safe=True)


@dataclass(frozen=True)
class RunConfig:
    name: str = setting("", help="Run folder name; empty = the preset's file name.", resume_safe=True)
    output_dir: str = setting("runs", help="Parent folder of run folders.", resume_safe=True)
    offer: str = setting(
        "", help="The machine offer the run is paid on, as NAME:RATE_PER_HOUR (estimate's --offer syntax; a third "
                 ":SEC_PER_UPDATE part is accepted and not used), e.g. \"RTX 4090 spot:0.44\": the log and progress "
                 "line show the cost so far, the record keeps the training session's cost (as `imglora estimate "
                 "RUN_DIR` computes it) and the budget guard projects at this rate (train.budget.currency).",
        resume_safe=True)
    log_with: list[Literal["tensorboard", "wandb"]] = setting(
        [], help="Experiment trackers (through accelerate): tensorboard (events in <run>/tensorboard), wandb (offline "
                 "unless run.wandb_mode = \"online\"). Training logs loss, lr, seconds per update, peak memory and "
                 "grad norm; `imglora eval` adds its contact sheets and held-out loss to the same run.",
        resume_safe=True)
    wandb_mode: Literal["offline", "online"] = setting(
        "offline", help="offline: wandb writes <run>/wandb/ only (`wandb sync` uploads it later); online needs "
                        "network and a login.", resume_safe=True)
    wandb_project: str = setting("imglora", help="The wandb project.", resume_safe=True)


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "cache": CacheConfig, "lora": LoraConfig,
    "train": TrainConfig, "memory": MemoryConfig, "eval": EvalConfig, "export": ExportConfig,
    "run": RunConfig,
}


@dataclass(frozen=True)
class Config:
    version: int
    model: ModelConfig
    data: DataConfig
    cache: CacheConfig
    lora: LoraConfig
    train: TrainConfig
    memory: MemoryConfig
    eval: EvalConfig
    export: ExportConfig
    run: RunConfig
    family: Any = None  # the family's own section ([<model.family>]), a dataclass of the family's, or None
    source: str = ""  # the preset file; not part of the configuration's identity
    notes: tuple[str, ...] = ()  # what loading changed on its own (migrated keys); said to the user, not identity

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        if self.family is not None:
            out[self.model.family] = dataclasses.asdict(self.family)
        return out

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with some fields changed, e.g. ``cfg.replace(train={"max_steps": 5})`` (unchecked);
        ``family={...}`` changes the family's own section."""
        changes = {k: dataclasses.replace(getattr(self, k), **v) for k, v in sections.items()}
        return dataclasses.replace(self, **changes)

    def hash(self, sections: tuple[str, ...] | None = None) -> str:
        """sha256 of the resolved configuration (or some sections of it)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
