"""The llm family: chat data and its loss mask, 4-bit base, PEFT adapter, merge, side-by-side answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.commands.common import load_config
from imglora.adapters import inject as lora
from imglora.families.llm.chat import IGNORE, encode, length_report, percentile, read_jsonl
from imglora.errors import ConfigError, DataError, ImgloraError
from imglora.families import get_family
from imglora.families.llm import ADAPTER_FILE, LlmTrainable
from imglora.models.resolve import ModelSource, resolve_model
from imglora.memory.wrap import resolve_swap
from imglora.memory.swap import NO_SWAP

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-llm.toml"

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("tiny:llm", get_family("llm")).root


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from imglora.families.llm.data import load_tokenizer

    return load_tokenizer(model_dir)


def quiet(_: str) -> None:
    pass


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# -- the assistant-only mask -------------------------------------------------------------------


def test_mask_token_by_token(tokenizer) -> None:
    enc = encode(tokenizer, CONVERSATION, max_seq_len=4096)
    ids, labels = enc.input_ids, enc.labels
    assert len(ids) == len(labels) == enc.length and not enc.truncated
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids

    # Expected, built independently: after each "<|im_start|>assistant\n" header, the content's
    # own tokens and <|im_end|>; nothing else (system, user turns, headers, the "\n" after
    # <|im_end|>) is supervised.
    expected = [IGNORE] * len(ids)
    starts = [i + len(header) for i in range(len(ids)) if ids[i:i + len(header)] == header]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(starts) == len(answers) == 2
    for start, content in zip(starts, answers):
        run = tokenizer(content, add_special_tokens=False).input_ids + [im_end]
        assert ids[start:start + len(run)] == run
        expected[start:start + len(run)] = run
    assert labels == expected

    assert supervised_text(tokenizer, ids, labels) == ["The capital of France is Paris.<|im_end|>",
                                                       "2 plus 3 is 5.<|im_end|>"]
    last = max(i for i, x in enumerate(labels) if x != IGNORE)
    assert labels[last + 1] == IGNORE and tokenizer.decode([ids[last + 1]]) == "\n"


def supervised_text(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive supervised tokens."""
    runs: list[list[int]] = []
    for i, (t, y) in enumerate(zip(ids, labels)):
        if y != IGNORE:
            assert y == t
            if not runs or labels[i - 1] == IGNORE:
                runs.append([])
            runs[-1].append(t)
    return [tokenizer.decode(r) for r in runs]


def test_mask_when_the_template_renders_earlier_turns_differently(tokenizer) -> None:
    """Like Qwen3's template: an empty think block only in the last assistant turn, so a prefix
    render is not a prefix of the full text; the mask then falls back to finding the content."""
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    e = encode(tok, CONVERSATION, 4096)
    assert supervised_text(tok, e.input_ids, e.labels) == [
        "The capital of France is Paris.<|im_end|>", "<think>\n\n</think>\n\n2 plus 3 is 5.<|im_end|>"]


def test_collated_loss_equals_transformers_loss(tokenizer, model_dir: Path) -> None:
    """The logits_to_keep loss (only supervised positions) equals the model's own labels loss."""
    from transformers import AutoModelForCausalLM

    family = get_family("llm")
    family.pad_id = tokenizer.pad_token_id
    entries = []
    for conv in (CONVERSATION, CONVERSATION[1:3]):  # two lengths: right padding
        e = encode(tokenizer, conv, 4096)
        entries.append({"input_ids": torch.tensor(e.input_ids), "labels": torch.tensor(e.labels)})
    batch = family.collate(entries)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = LlmTrainable(model).loss(batch)
        theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       labels=batch["labels"]).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# -- truncation report and malformed data ------------------------------------------------------


def test_length_report_values() -> None:
    r = length_report([10, 20, 30, 40, 1000], max_seq_len=35)
    assert (r.n, r.truncated, r.longest) == (5, 2, 1000)
    assert r.median == 30 and r.p95 == pytest.approx(808.0)  # 40 + 0.8 * (1000 - 40), as numpy
    import numpy as np

    xs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert percentile(xs, 95) == pytest.approx(np.percentile(xs, 95))
    assert "2 of 5 conversations (40.0%)" in r.warning() and "raise llm.max_seq_len to about 808" in r.warning()
    assert length_report([5, 6], 10).warning() is None


def test_prepare_data_truncates_reports_and_skips(tmp_path: Path, model_dir: Path) -> None:
    long_user = {"role": "user", "content": "the quick brown fox " * 40}
    rows = [{"messages": CONVERSATION[1:3]}] * 3 + [
        {"messages": [long_user, {"role": "assistant", "content": "Paris."}]},  # answer cut off entirely
        {"messages": [CONVERSATION[1], {"role": "assistant", "content": "The capital is Paris. " * 30}]},
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = load_config(PRESET, [f"llm.data_file={json.dumps(str(data))}", "llm.max_seq_len=64",
                               'llm.holdout_file=""', "llm.holdout_fraction=0.0"])
    family = get_family("llm")
    prepared = family.prepare_data(cfg, ModelSource(model_dir), torch.device("cpu"))
    assert len(prepared.samples) == 4 and not prepared.validation
    assert any("2 of 5 conversations (40.0%) are longer than llm.max_seq_len = 64" in w for w in prepared.warnings)
    assert any(f"1 conversation has no assistant token within llm.max_seq_len = 64; skipped: {data}:4 ("
               in w for w in prepared.warnings)
    assert "median" in prepared.summary and "95th percentile" in prepared.summary
    cut = prepared.samples[-1].variants[0]
    assert cut["input_ids"].numel() == 64 and (cut["labels"] != IGNORE).any()
    assert prepared.samples[0].bucket == (64, 0)
    import hashlib

    assert prepared.version == hashlib.sha256(data.read_bytes()).hexdigest()


def test_holdout_fraction_is_deterministic(tmp_path: Path, model_dir: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}]} for i in range(20)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    over = [f"llm.data_file={json.dumps(str(data))}", 'llm.holdout_file=""', "llm.holdout_fraction=0.2"]
    family = get_family("llm")
    a = family.prepare_data(load_config(PRESET, over), ModelSource(model_dir), torch.device("cpu"))
    b = family.prepare_data(load_config(PRESET, over), ModelSource(model_dir), torch.device("cpu"))
    assert (len(a.samples), len(a.validation)) == (16, 4)
    assert [s.variants[0]["input_ids"].tolist() for s in a.validation] == \
           [s.variants[0]["input_ids"].tolist() for s in b.validation]
    train_ids = {tuple(s.variants[0]["input_ids"].tolist()) for s in a.samples}
    assert not train_ids & {tuple(s.variants[0]["input_ids"].tolist()) for s in a.validation}


def test_malformed_jsonl_names_every_line(tmp_path: Path) -> None:
    ok = json.dumps({"messages": CONVERSATION[1:3]})
    path = write_jsonl(tmp_path / "bad.jsonl", [
        ok,
        '{"messages": [',                                                          # 2 invalid JSON
        json.dumps({"conversation": []}),                                          # 3 no "messages"
        json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),              # 4 bad role
        json.dumps({"messages": [{"role": "user", "content": ["a", "b"]},
                                 {"role": "assistant", "content": "x"}]}),          # 5 content not a string
        "",                                                                         # 6 blank: skipped
        json.dumps({"messages": [{"role": "user", "content": "hello"}]}),          # 7 no assistant turn
        ok,
    ])
    with pytest.raises(DataError) as exc:
        read_jsonl(path)
    problems = exc.value.problems
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in (2, 3, 4, 5, 7)]
    assert "invalid JSON" in problems[0]
    assert 'missing "messages"' in problems[1]
    assert "bad role 'bot'" in problems[2]
    assert "content is a list, not a string" in problems[3]
    assert "no assistant turn" in problems[4]
    assert str(exc.value).startswith("5 problems in the dataset:")
    assert len(read_jsonl(write_jsonl(tmp_path / "good.jsonl", [ok, "", ok]))) == 2


# -- 4-bit base ----------------------------------------------------------------------------------


def test_qint4_keeps_lora_trainable_and_saves_memory(model_dir: Path) -> None:
    from imglora.memory.quant4 import quantize_4bit

    family = get_family("llm")
    cfg = load_config(PRESET)
    swap = resolve_swap(family, cfg, ModelSource(model_dir))
    trainable = family.load_trainable(ModelSource(model_dir), cfg, torch.device("cpu"), torch.float32, swap)
    model = trainable.model
    lora.inject(model, family, cfg.lora, seed=0)
    report = quantize_4bit(model, family.quantize_exclude, "qint4")
    assert report.bytes_after < report.bytes_before
    assert report.n_quantized == 14 and report.kept == ("lm_head.base_layer",)  # 2 layers x 7 projections
    qweight = model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert type(qweight).__name__ == "WeightQBitsTensor" and not qweight.requires_grad
    named = dict(model.named_parameters())
    assert all(p.requires_grad == ("lora_" in n) for n, p in named.items())
    with torch.no_grad():  # B = 0 at init: make the LoRA path matter so every A gets a gradient
        for n, p in named.items():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    model.train()
    ids = torch.randint(0, 500, (2, 12))
    batch = family.collate([{"input_ids": ids[0], "labels": ids[0]}, {"input_ids": ids[1], "labels": ids[1]}])
    trainable.loss(batch).backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in named.items())
    assert all(p.grad.abs().sum() > 0 for n, p in named.items() if "lora_" in n)


def test_nf4_without_bitsandbytes_says_how_to_fix(monkeypatch) -> None:
    pytest.importorskip("optimum.quanto")
    import sys

    from imglora.memory.quant4 import quantize_4bit

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed (CI installs it for 8-bit optimizers)
    with pytest.raises(ImgloraError, match="needs bitsandbytes \\(CUDA\\): pip install bitsandbytes, or use qint4"):
        quantize_4bit(torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False)), (), "nf4")


# -- training, adapter, merge, evaluation --------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from imglora.commands.train import train

    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(PRESET, [f"run.output_dir={json.dumps(str(out))}", "train.max_steps=8", "eval.every=4",
                               "train.checkpoint_every=4", "train.log_every=2", "train.warmup_steps=0"])
    lines: list[str] = []
    result = train(cfg, out=lines.append)
    return cfg, result, lines


def test_training_logs_validation_and_records_qint4(run) -> None:
    from imglora.runs.record import read_records

    cfg, _, lines = run
    rows = [json.loads(x) for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    assert any(line.startswith("qint4: 14 Linear layers quantized") for line in lines)
    rec = read_records(cfg.run_dir, "train")[-1]
    assert rec["status"] == "ok" and rec["steps_done"] == 8 and len(rec["dataset_version"]) == 64
    assert rec["memory"]["qint4"]["bytes_after"] < rec["memory"]["qint4"]["bytes_before"]
    assert rec["final_val_loss"] == pytest.approx(val[-1])
    # the preset's auto 4-bit base: on the CPU, qint4, and the run says why
    assert cfg.memory.quantization == "auto"
    assert rec["memory"]["quantization"] == {"setting": "auto", "ran": "qint4",
                                             "why": "auto: not a CUDA device (bitsandbytes' NF4 runs on CUDA)"}
    assert 'memory.quantization = "auto": qint4 (not a CUDA device (bitsandbytes\' NF4 runs on CUDA))' in lines


def test_auto_is_nf4_on_cuda_with_bitsandbytes_else_qint4(monkeypatch) -> None:
    """QLoRA's recipe (bitsandbytes NF4, double quantization) where it runs; qint4 elsewhere."""
    import importlib.util

    from imglora.util import devices
    from imglora.memory.quant4 import resolve

    assert resolve("nf4", "cpu") == ("nf4", "as set") and resolve("qint4", "cuda") == ("qint4", "as set")
    monkeypatch.setattr(devices, "is_cuda", lambda device: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else real(name, *a))
    assert resolve("auto", "cuda") == ("nf4", "auto: a CUDA GPU with bitsandbytes")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert resolve("auto", "cuda") == ("qint4", 'auto: bitsandbytes is not installed (pip install "imglora[bnb]" for NF4)')
    with pytest.raises(ConfigError, match=r"memory.quantization: 4-bit quantization is for the llm family; the flux"):
        load_config(REPO / "presets" / "tiny-flux.toml", ['memory.quantization="auto"', "memory.fp8=false"])


def test_adapter_loads_in_peft_changes_logits_and_merges(run, model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from imglora.commands.merge import merge

    cfg, result, _ = run
    adapter = result.adapter.parent
    assert result.adapter == adapter / ADAPTER_FILE
    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert meta["task_type"] == "CAUSAL_LM" and meta["peft_type"] == "LORA"
    assert meta["base_model_name_or_path"] == str(model_dir.resolve()) and meta["r"] == 8
    weights = load_file(str(result.adapter))
    assert weights and all(k.startswith("base_model.model.") and ".lora_" in k for k in weights)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in weights

    ids = torch.tensor([[513, 84, 320, 198, 360, 365, 298, 265, 348, 514, 198, 513, 64, 305, 198]])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2

    # read_adapter gives the keys lora.load_adapter_state expects (the resume path).
    family = get_family("llm")
    swap = resolve_swap(family, cfg, ModelSource(model_dir))
    trainable = family.load_trainable(ModelSource(model_dir), cfg, torch.device("cpu"), torch.float32, swap)
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    lora.load_adapter_state(trainable.model, family.read_adapter(adapter))
    with torch.no_grad():
        ours = trainable.model.eval()(input_ids=ids).logits
    torch.testing.assert_close(ours, peft_logits, rtol=1e-5, atol=1e-5)

    out = merge(cfg.run_dir, tmp_path / "merged", log=quiet)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)
    assert (out / "tokenizer_config.json").is_file()
    with pytest.raises(ImgloraError, match="exists and is not empty"):
        merge(cfg.run_dir, out, log=quiet)
    assert merge(cfg.run_dir, out, which="latest", force=True, log=quiet) == out
    # --force replaces an earlier merge only, never e.g. the base model's folder.
    with pytest.raises(ImgloraError, match="--force only replaces an earlier merge"):
        merge(cfg.run_dir, model_dir, force=True, log=quiet)
    assert (model_dir / "config.json").is_file()
    with pytest.raises(ImgloraError, match="no such checkpoint"):
        merge(cfg.run_dir, tmp_path / "x", which="3", log=quiet)


def test_merge_cli(run, tmp_path: Path) -> None:
    import click
    from click.testing import CliRunner

    from imglora.cli import merge_cmd

    cfg, _, _ = run
    group = click.Group(commands={"merge": merge_cmd})
    result = CliRunner().invoke(group, ["merge", str(cfg.run_dir), "--out", str(tmp_path / "m"), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "merged" in result.output and (tmp_path / "m" / "config.json").is_file()


@pytest.mark.slow
def test_eval_pass_writes_answers_with_and_without_adapter(run) -> None:
    from imglora.commands.evaluate import evaluate

    cfg, _, _ = run
    lines: list[str] = []
    result = evaluate(cfg.run_dir, strengths=[0.0, 1.0], out=lines.append)
    step = result.steps[-1]
    sheet = result.sheets[step]
    assert sheet.name == "answers.md"
    text = sheet.read_text()
    prompts = get_family("llm").default_prompts(cfg)
    assert prompts and all(f"## {p}" in text for p in prompts)
    assert text.count("**base model**") == len(prompts) and text.count("**adapter, strength 1**") == len(prompts)
    assert "held-out loss" in text
    base, tuned = (p.read_text() for p in result.images[step][0])
    assert base != tuned  # the adapter changes the answer
    losses = result.losses[step]
    assert losses["heldout"] is not None and losses["heldout"] < result.base_loss["heldout"]


def test_full_architecture_and_synthetic_batch_for_benchmarks(monkeypatch) -> None:
    from imglora.families import llm

    # The real Qwen2.5-7B layout, shrunk: the code path of `bench-swap --arch full` in seconds.
    monkeypatch.setattr(llm, "FULL_CONFIG", {**llm.FULL_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                                             "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "vocab_size": 600, "bos_token_id": 1,
                                             "eos_token_id": 2, "pad_token_id": 0})
    cfg = load_config(PRESET, ["llm.max_seq_len=32"])
    family = get_family("llm")
    trainable = family.full_trainable(cfg, torch.float32, NO_SWAP)
    assert torch.isfinite(trainable.model.model.rotary_emb.inv_freq).all()
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    batch = family.synthetic_batch(trainable, 0, cfg, torch.device("cpu"))
    assert batch["input_ids"].shape == (cfg.train.batch_size, 32) and batch["targets"].numel() == 4 * 31
    loss = trainable.loss(batch)
    assert torch.isfinite(loss)


def test_export_of_an_llm_run_says_what_to_use_instead(run) -> None:
    from imglora.errors import ImgloraError
    from imglora.commands.export import export

    cfg, _, _ = run
    with pytest.raises(ImgloraError) as exc:
        export(cfg.run_dir)
    msg = str(exc.value)
    assert "export writes image-model LoRAs" in msg and "a PEFT adapter folder" in msg and f"imglora merge {cfg.run_dir}" in msg


def test_a_resume_on_a_machine_where_auto_picks_another_base_is_refused(run, monkeypatch) -> None:
    """A run trained with memory.quantization = "auto" on one 4-bit kind does not continue on another."""
    from imglora.training import checkpoint
    from imglora.commands.train import train
    from imglora.memory import quant4

    cfg, _, _ = run
    (step, path), *_ = reversed(checkpoint.list_checkpoints(cfg.run_dir))
    assert checkpoint.load(path)["quantization_ran"] == "qint4"
    resumed = cfg.replace(train={"max_steps": 12})
    real_resolve = quant4.resolve
    monkeypatch.setattr(quant4, "resolve", lambda kind, device: (
        "nf4" if kind == "auto" else real_resolve(kind, device)[0], "auto: a CUDA GPU with bitsandbytes"))
    monkeypatch.setattr(quant4, "quantize_4bit", lambda model, exclude, kind, device=None: quant4.QuantReport(
        0, 0, 0, 0, (), kind))
    with pytest.raises(checkpoint.ResumeRefused, match=r"trained on a qint4 base, and this machine would run nf4 "
                                                      r"\(auto: a CUDA GPU with bitsandbytes\)"):
        train(resumed, resume=True, out=lambda s: None)
