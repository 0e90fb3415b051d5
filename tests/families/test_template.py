"""The family template (``families/_template``) stays a faithful starting point: it has every member,
with the same parameters, of each protocol an image family implements, every place left to fill
says so and points at the README, and it is never registered."""

from __future__ import annotations

import inspect

import pytest

from imglora import family as protocols
from imglora.families import FAMILIES, registry
from imglora.families._template import TemplateFamily

PROTOCOLS = (protocols.Family, protocols.CacheEncoder, protocols.Sampler, protocols.Swappable, protocols.Benchable,
             protocols.Plannable, protocols.Exportable, protocols.SingleFiles)


def members(protocol: type) -> dict[str, object]:
    own = {k: v for k, v in vars(protocol).items() if not k.startswith("_")}
    return own | {k: None for k in getattr(protocol, "__annotations__", {})}


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_the_template_has_every_member_of_the_protocols_with_their_parameters(protocol) -> None:
    t = TemplateFamily()
    assert protocols.supports(t, protocol)
    for name, member in members(protocol).items():
        assert hasattr(t, name), f"{protocol.__name__}.{name} is missing from the template"
        if inspect.isfunction(member):
            want = list(inspect.signature(member).parameters)
            got = list(inspect.signature(getattr(TemplateFamily, name)).parameters)
            if got[0] != "self":  # a shared helper bound as a method: (family, ...)
                got = ["self", *got[1:]]
            assert got[:len(want)] == want, f"{protocol.__name__}.{name}: {got} != {want}"


def test_every_place_left_to_fill_says_so_and_it_is_never_registered() -> None:
    assert "template" not in registry.names() and TemplateFamily not in FAMILIES.values()
    t = TemplateFamily()
    with pytest.raises(NotImplementedError, match=r"^TEMPLATE: the latents as the training script scales them .*"
                                                  r"_template/README.md\)$"):
        t.encode_image(None, None)
    todo = [n for n, f in vars(TemplateFamily).items() if inspect.isfunction(f) and "raise todo(" in inspect.getsource(f)]
    assert len(todo) >= 15  # the family-specific parts: data, model, swap, sampler, export
    for name in todo:
        with pytest.raises(NotImplementedError, match="^TEMPLATE: "):
            n = len(inspect.signature(getattr(TemplateFamily, name)).parameters) - 1
            getattr(t, name)(*[None] * n)
