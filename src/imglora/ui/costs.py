"""The New run page's cost estimate: for each GPU offer entered, the session's hours and cost at the
speed the plan gives for that card (measured where a bench file measured it, else predicted), or at
the seconds per update the offer states (measured there). The same session formula as ``imglora
estimate`` (:mod:`imglora.runs.cost`); before a run there is nothing measured of set-up, caching,
checkpoint saves or evaluation, so those terms are the user's "idle" minutes and say so."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ..runs import cost as ec
from ..plan import timing as plan_time
from ..errors import ImgloraError
from ..plan.predict import GiB


def card_of(offer_name: str, default: str) -> str:
    """The card an offer names ("runpod H100 PCIe", "vast-rtx4090"), longest name first; else ``default``."""
    text = re.sub(r"[\s_]+", "-", offer_name.lower()).replace("rtx-", "").replace("rtx", "")
    for key in sorted(plan_time.GPUS, key=len, reverse=True):
        if re.search(rf"(?<![0-9a-z]){re.escape(key)}(?![0-9])", text):
            return key
    return default


@dataclass(frozen=True)
class OfferRow:
    offer: str
    rate: float
    card: str
    setting: str | None
    seconds_per_update: float | None
    basis: str
    hours: float | None
    cost: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def offer_rows(offers: list[str], default_card: str, steps: int, checkpoint_every: int, idle_minutes: float,
               currency: str, plan_for: Callable[[str], Any]) -> list[OfferRow]:
    """One row per offer. ``plan_for(card)``: the plan (:class:`imglora.plan.Plan`) for that card, its
    first setting the preset's own. The preset's setting is used where it fits the card, else the
    fastest that fits (named in the row's basis)."""
    rows = []
    for text in offers:
        try:
            name, rate, given = ec.parse_offer(text.strip())
        except ValueError as exc:
            raise ImgloraError(f"offer {exc}") from None
        card = card_of(name, default_card)
        dev = plan_time.gpu(card)
        plan = plan_for(card)
        own = plan.settings[0]
        chosen, why = own, ""
        if not own.fits(int(dev.vram_gib * GiB), None, "cuda"):
            chosen = next((s for s in plan.settings if s.setting.name == plan.fastest_fit), None)
            why = (f"the preset's {own.setting.name} does not fit its {dev.vram_gib:g} GiB; "
                   + (f"{chosen.setting.name}, the fastest that fits" if chosen else "no setting fits"))
        if chosen is None:
            rows.append(OfferRow(name, rate, card, None, None, why, None, None))
            continue
        if given is not None:
            spu, basis = given, "s/update as the offer states (measured there)"
        elif chosen.measured_seconds is not None:
            spu, basis = chosen.measured_seconds, f"measured on the {dev.label} (bench file)"
        elif chosen.predicted is not None:
            spu, basis = chosen.predicted.seconds, f"predicted for the {dev.label} by the plan (not measured)"
        else:
            note = chosen.time_note or "the plan has no time for it"
            rows.append(OfferRow(name, rate, card, chosen.setting.name, None,
                                 f"no s/update: {note}; write the offer as NAME:RATE:SEC_PER_UPDATE", None, None))
            continue
        inputs = ec.SessionInputs(setup=0.0, cache=0.0, steps=steps, seconds_per_update=spu,
                                  checkpoints=ec.checkpoint_count(steps, checkpoint_every), seconds_per_checkpoint=0.0,
                                  idle=idle_minutes * 60)
        est = ec.estimate(inputs, rate, currency)
        rows.append(OfferRow(name, rate, card, chosen.setting.name, spu, "; ".join(x for x in (why, basis) if x),
                             est.hours, est.cost))
    return rows
