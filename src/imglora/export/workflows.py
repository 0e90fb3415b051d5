"""ComfyUI workflows for an exported LoRA.

A family describes its workflow once, as a table of nodes (``Node``, built with the helpers
below), and this module writes it in both formats ComfyUI reads:
the API format (what ``POST /prompt`` takes) and the UI graph (what the browser loads when the
file is dropped onto it). Both come from the same table, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UI_ONLY = None  # widget with no API input, e.g. KSampler's control_after_generate


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[int, int]
    links: list[tuple[str, str, tuple[int, int]]] = field(default_factory=list)  # (input, TYPE, (node, slot))
    widgets: list[tuple[str | None, Any]] = field(default_factory=list)  # (input name or UI_ONLY, value)
    outputs: list[str] = field(default_factory=list)  # output TYPE per slot (names equal types here)
    size: tuple[int, int] = (315, 110)


@dataclass(frozen=True)
class Sampling:
    """The family's usual settings, as in ComfyUI's example workflows."""
    width: int
    height: int
    steps: int
    cfg: float
    sampler: str
    scheduler: str
    guidance: float | None = None  # FLUX distilled guidance (FluxGuidance); None = no such node




def file_name(value: str, comfyui: str, default: str) -> str:
    """How a ComfyUI loader node names a model file the run was trained from: as the preset gave it
    when it was looked up in ComfyUI's folders (a bare or folder-relative name), else its file name;
    ``default`` when the model was not given as files."""
    if not value or not Path(value).suffix:
        return default
    return value if comfyui and not Path(value).is_absolute() else Path(value).name


def ksampler(id_: int, pos, model, positive, negative, latent, seed: int, s: Sampling) -> Node:
    return Node(id_, "KSampler", pos, links=[("model", "MODEL", model), ("positive", "CONDITIONING", positive),
                                             ("negative", "CONDITIONING", negative),
                                             ("latent_image", "LATENT", latent)],
                widgets=[("seed", seed), (UI_ONLY, "fixed"), ("steps", s.steps), ("cfg", s.cfg),
                         ("sampler_name", s.sampler), ("scheduler", s.scheduler), ("denoise", 1.0)],
                outputs=["LATENT"], size=(315, 262))


def text_node(id_: int, pos, clip, text: str) -> Node:
    return Node(id_, "CLIPTextEncode", pos, links=[("clip", "CLIP", clip)], widgets=[("text", text)],
                outputs=["CONDITIONING"], size=(400, 160))


def to_api(nodes: list[Node]) -> dict[str, Any]:
    """API format: ``{"<id>": {"class_type", "inputs": {name: value or [source id, slot]}}}``."""
    out = {}
    for n in nodes:
        inputs: dict[str, Any] = {name: [str(src), slot] for name, _, (src, slot) in n.links}
        inputs.update({name: value for name, value in n.widgets if name is not UI_ONLY})
        out[str(n.id)] = {"class_type": n.type, "inputs": inputs, "_meta": {"title": n.type}}
    return out


def to_ui(nodes: list[Node]) -> dict[str, Any]:
    """UI graph (workflow schema 0.4): nodes with widgets_values, and links
    ``[id, source node, source slot, target node, target slot, TYPE]`` that both ends name."""
    links: list[list[Any]] = []
    out_links: dict[tuple[int, int], list[int]] = {}
    ui_nodes = []
    for order, n in enumerate(nodes):  # the table is in execution order
        inputs = []
        for slot, (name, type_, (src, src_slot)) in enumerate(n.links):
            link_id = len(links) + 1
            links.append([link_id, src, src_slot, n.id, slot, type_])
            out_links.setdefault((src, src_slot), []).append(link_id)
            inputs.append({"name": name, "type": type_, "link": link_id})
        node: dict[str, Any] = {"id": n.id, "type": n.type, "pos": list(n.pos), "size": list(n.size), "flags": {},
                                "order": order, "mode": 0, "properties": {"Node name for S&R": n.type}}
        if inputs:
            node["inputs"] = inputs
        if n.widgets:
            node["widgets_values"] = [value for _, value in n.widgets]
        ui_nodes.append(node)
    for n, node in zip(nodes, ui_nodes):
        if n.outputs:
            node["outputs"] = [{"name": t, "type": t, "links": out_links.get((n.id, slot), []), "slot_index": slot}
                               for slot, t in enumerate(n.outputs)]
    return {"last_node_id": max(n.id for n in nodes), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}},
            "version": 0.4}
