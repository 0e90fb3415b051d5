"""memory.op_count: the kernels of a step on the meta device, with their FLOPs, bytes, kind and block."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from imglora.plan.meta_run import Autocast, flash_attention
from imglora.plan.op_count import ATTENTION, BACKWARD, BASE, FORWARD, MATMUL, OpCounter

META = torch.device("meta")


class Layer(torch.nn.Module):
    """A frozen base Linear with a trainable low-rank side, as a LoRA layer is."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)
        self.a = torch.nn.Linear(n_in, 2, bias=False)
        self.b = torch.nn.Linear(2, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def test_a_frozen_weights_products_are_counted_forward_and_input_gradient_never_its_weight_gradient() -> None:
    model = torch.nn.Sequential(Layer(32, 48), torch.nn.GELU(), Layer(48, 16, bias=False)).to(META)
    x = torch.empty(2, 10, 32, device=META, requires_grad=True)
    with OpCounter(model, [], recompute_tags=False) as c:
        model(x).sum().backward()
    base = [o for o in c.tally.ops if o.kind == BASE]
    assert [(o.layer, o.role, o.phase) for o in base] == [
        ("0.base", "fwd", FORWARD), ("2.base", "fwd", FORWARD), ("2.base", "dgrad", BACKWARD),
        ("0.base", "dgrad", BACKWARD)]
    first = base[0]
    assert first.flops == 2 * 20 * 32 * 48 and first.shape == (20, 32, 48) and first.bias
    assert first.weight == 32 * 48 and first.other == 20 * 32
    assert base[2].flops == 2 * 20 * 48 * 16 and not base[2].bias and base[2].other == 20 * 16
    # the x @ W.t() product reads x, W and the bias, and writes the output, all fp32
    assert first.bytes == 4 * (20 * 32 + 32 * 48 + 48 + 20 * 48)
    assert c.tally.layers == {"0.base": 32 * 48, "2.base": 48 * 16}
    # the adapter's own products: forward, and in backward the input and weight gradient of each of the 4
    lora = [o for o in c.tally.ops if o.kind == MATMUL]
    assert sum(o.phase == FORWARD for o in lora) == 4 and sum(o.phase == BACKWARD for o in lora) == 8


def test_autocasts_copy_of_a_weight_is_still_that_layers_product_and_views_are_not_kernels() -> None:
    model = Layer(32, 48).to(META)
    x = torch.empty(20, 32, device=META, requires_grad=True)
    with Autocast(torch.bfloat16), OpCounter(model, [], recompute_tags=False) as c:
        model(x).sum().backward()
    base = [o for o in c.tally.ops if o.kind == BASE]
    assert [(o.role, o.dtype) for o in base] == [("fwd", torch.bfloat16), ("dgrad", torch.bfloat16)]
    with OpCounter(model, [], recompute_tags=False) as c:
        x.view(4, 5, 32).transpose(1, 2).unsqueeze(0).detach()
    assert c.tally.ops == []


def test_attention_is_counted_as_a_flash_kernel_does_its_work() -> None:
    q = torch.empty(2, 3, 64, 8, device=META, requires_grad=True)
    with OpCounter(torch.nn.Module(), [], recompute_tags=False) as c:
        flash_attention(q, q, q).sum().backward()
    attn = [o for o in c.tally.ops if o.kind == ATTENTION]
    assert [(o.phase, o.flops) for o in attn] == [(FORWARD, 4 * 2 * 3 * 64 * 64 * 8), (BACKWARD, 10 * 2 * 3 * 64 * 64 * 8)]


def test_ops_are_tagged_with_their_block_and_a_recompute_tags_the_backward_that_follows() -> None:
    blocks = torch.nn.ModuleList(Layer(16, 16) for _ in range(3)).to(META)
    model = torch.nn.Module()
    model.blocks = blocks
    x = torch.empty(8, 16, device=META, requires_grad=True)
    with OpCounter(model, ["blocks"], recompute_tags=True) as c:
        h = x * 2
        for blk in blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        (h * 3).sum().backward()
    assert c.tally.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    fwd = [o.block for o in c.tally.ops if o.phase == FORWARD]
    assert fwd[0] == -1 and fwd[-1] == -1 and [b for b in dict.fromkeys(fwd) if b >= 0] == [0, 1, 2]
    dgrads = [(o.block, o.layer) for o in c.tally.ops if o.kind == BASE and o.role == "dgrad"]
    assert dgrads == [(2, "blocks.2.base"), (1, "blocks.1.base"), (0, "blocks.0.base")]
    recomputes = [o.block for o in c.tally.ops if o.kind == BASE and o.role == "fwd" and o.phase == BACKWARD]
    assert recomputes == [2, 1, 0]


def test_offloading_binds_torchs_own_checkpoint_even_when_first_imported_inside_a_meta_run() -> None:
    """offload.py binds torch.utils.checkpoint.checkpoint at import; a first import while the meta
    run's Autocast has it replaced once made every later real training step run under the meta
    run's mode (found by a plan run before a real step in one process)."""
    import subprocess
    import sys

    code = ("import torch.utils.checkpoint as c; real = c.checkpoint\n"
            "from imglora.plan import meta_run\n"
            "with meta_run.Autocast(None):\n"
            "    from imglora.memory import offload\n"
            "assert offload.checkpoint is real and c.checkpoint is real, offload.checkpoint\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
