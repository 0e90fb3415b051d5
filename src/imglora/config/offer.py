"""An offer (``NAME:RATE[:SEC_PER_UPDATE]``) and when the budget guard projects a session: what the
config checks need of the cost model, with nothing above the config (``imglora.runs.cost`` builds on it)."""

from __future__ import annotations

import math


WARMUP_UPDATES = 3  # excluded from steady-state timing (allocator warm-up, first-call compilation)


def projection_update(smoke_steps: int, log_every: int) -> int:
    """The update at which training projects the session (the budget guard's one check): the first
    log (every ``log_every`` updates) once warm-up and ``smoke_steps`` measured updates have run. A
    run that ends at or before it is never projected."""
    return math.ceil((WARMUP_UPDATES + smoke_steps) / log_every) * log_every


def parse_offer(text: str) -> tuple[str, float, float | None]:
    """``NAME:RATE`` or ``NAME:RATE:SEC_PER_UPDATE`` (the name may hold colons) -> (name, rate, seconds
    per update or None); ValueError with what is wrong."""
    parts = text.rsplit(":", 2)
    try:
        if len(parts) == 3 and _is_number(parts[1]):
            name, rate, spu = parts[0], float(parts[1]), float(parts[2])
        else:
            name, rate_text = text.rsplit(":", 1)
            rate, spu = float(rate_text), None
    except ValueError:
        raise ValueError(f"{text!r}: expected NAME:RATE or NAME:RATE:SEC_PER_UPDATE, e.g. \"RTX 4090:0.44:2.1\"") \
            from None
    if not name.strip() or not math.isfinite(rate) or rate < 0 or (spu is not None and (not math.isfinite(spu)
                                                                                         or spu <= 0)):
        raise ValueError(f"{text!r}: a name, a rate that is a finite number >= 0 and seconds per update that are a "
                         "finite number > 0")
    return name, rate, spu


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
