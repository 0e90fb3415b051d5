"""Optimizers by name: ``train.optimizer`` and ``train.optimizer_args``.

A name is one of the known optimizers below, a ``torch.optim`` class (``"SGD"``, ``"RAdam"``; any
case), or a dotted path to a class (``"mypackage.optim.Fancy"``). The optimizer gets
``train.learning_rate``; Adam-style optimizers also ``train.adam_beta1``/``adam_beta2``/``adam_eps``;
every one that takes it ``train.weight_decay``; then ``train.optimizer_args`` are passed through
and override those. A name that is none of these, or an argument the class does not take, is a
config error; a package that is not installed is one error naming its ``pip install``, before
anything is loaded.

Naming a class imports its module, and importing runs the module's code (``this`` prints a poem,
any installed package may do anything). So a dotted path is taken only inside ``TRUSTED`` (torch
and the optimizer packages above) unless ``train.optimizer_allow_any = true``; the module is then
imported when the config is checked, and what the name gives must be a ``torch.optim.Optimizer``
subclass (``issubclass``) before it is ever called.

Optimizers with a train and an eval mode (schedule-free: the weights it steps are not the weights
to use, ``optimizer.eval()`` gives those) are switched by the training loop wherever weights are
saved or evaluated (``loop.eval_weights``), and the weights it steps are saved for resuming.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ImgloraError

if TYPE_CHECKING:
    from .schema import Config


def _optimizer_base() -> type:
    import torch  # (here, not at the top: the config is read without torch)

    return torch.optim.Optimizer


@dataclass(frozen=True)
class Known:
    path: str                         # module.Class
    pip: str | None = None            # the package to install, when not a core dependency
    adam: bool = False                # takes betas=(beta1, beta2) and eps
    fixed: dict[str, Any] = field(default_factory=dict)  # always passed (before optimizer_args)


KNOWN: dict[str, Known] = {
    "adamw": Known("torch.optim.AdamW", adam=True),
    "adafactor": Known("transformers.optimization.Adafactor",
                       fixed={"relative_step": False, "scale_parameter": False, "warmup_init": False}),
    "adamw8bit": Known("bitsandbytes.optim.AdamW8bit", "bitsandbytes", adam=True),
    "paged_adamw8bit": Known("bitsandbytes.optim.PagedAdamW8bit", "bitsandbytes", adam=True),
    "lion8bit": Known("bitsandbytes.optim.Lion8bit", "bitsandbytes"),
    "prodigy": Known("prodigyopt.Prodigy", "prodigyopt", adam=True),  # estimates its step size: learning_rate 1.0
    "schedulefree_adamw": Known("schedulefree.AdamWScheduleFree", "schedulefree", adam=True),
}


# Modules a dotted train.optimizer may name without train.optimizer_allow_any (and their submodules).
TRUSTED = ("torch", "bitsandbytes", "prodigyopt", "schedulefree", "transformers.optimization")
ALLOW_ANY = "train.optimizer_allow_any"


def trusted(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TRUSTED)


@dataclass(frozen=True)
class Resolved:
    name: str
    path: str         # module.Class
    pip: str | None   # what `pip install` would bring it
    adam: bool
    fixed: dict[str, Any]

    @property
    def module(self) -> str:
        return self.path.rpartition(".")[0]

    def installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.module.split(".")[0]) is not None
        except (ImportError, ValueError):
            return False

    def refusal(self, allow_any: bool) -> str | None:
        """Why this name may not even be imported, or None: a module outside ``TRUSTED`` without
        the opt-in (checked before importing: importing already runs the module's code)."""
        if allow_any or trusted(self.module):
            return None
        return (f'train.optimizer = "{self.name}": {self.module} is not one of the optimizer modules imglora '
                f"imports on its own ({', '.join(TRUSTED)}), and importing a module runs its code; for your "
                f"own optimizer class, set {ALLOW_ANY} = true")

    def load(self, allow_any: bool = False) -> type:
        """The optimizer class, imported: refused before importing when ``refusal`` says so, and
        after it unless it is a ``torch.optim.Optimizer`` subclass (nothing is called before)."""
        if why := self.refusal(allow_any):
            raise ImgloraError(why)
        top, attr = self.module.split(".")[0], self.path.rpartition(".")[2]
        try:
            obj = getattr(importlib.import_module(self.module), attr)
        except ModuleNotFoundError as exc:
            if exc.name != top and importlib.util.find_spec(top) is not None:
                raise ImgloraError(f'train.optimizer = "{self.name}": there is no module {exc.name}') from None
            raise ImgloraError(f'train.optimizer = "{self.name}" needs {self.pip or top}: '
                               f"`pip install {self.pip or top}`") from None
        except AttributeError:
            raise ImgloraError(f'train.optimizer = "{self.name}": {self.module} has no {attr}') from None
        except Exception as exc:  # noqa: BLE001 - importing someone's module (allowed by the opt-in) failed
            raise ImgloraError(f'train.optimizer = "{self.name}": importing {self.module} failed: '
                               f"{type(exc).__name__}: {exc}") from None
        if not (isinstance(obj, type) and issubclass(obj, _optimizer_base())):
            what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
            raise ImgloraError(f'train.optimizer = "{self.name}": {self.path} is {what}, not a '
                               "torch.optim.Optimizer subclass; name an optimizer class")
        return obj


def _torch_optimizers() -> dict[str, str]:
    import torch

    return {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}


def resolve(name: str) -> Resolved | str:
    """The optimizer ``name`` stands for, or why it stands for none (a message)."""
    if name in KNOWN:
        k = KNOWN[name]
        return Resolved(name, k.path, k.pip, k.adam, dict(k.fixed))
    torch_names = _torch_optimizers()
    if name.lower() in torch_names:
        return Resolved(name, f"torch.optim.{torch_names[name.lower()]}", None, False, {})
    if "." in name.strip(".") and all(part.isidentifier() for part in name.split(".")):
        return Resolved(name, name, None, False, {})
    close = difflib.get_close_matches(name.lower(), [*KNOWN, *torch_names], n=1, cutoff=0.6)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return (f"unknown optimizer {name!r}{hint}: use {', '.join(KNOWN)}, a torch.optim class (e.g. SGD, RAdam), "
            "or a dotted path to an optimizer class")


def keyword_arguments(cfg: "Config", r: Resolved, cls: type | None) -> dict[str, Any]:
    """What the optimizer is built with, ``params`` aside: the learning rate, the Adam settings for
    Adam-style optimizers, weight decay where the class takes it, then ``train.optimizer_args``."""
    t = cfg.train
    kwargs: dict[str, Any] = {"lr": t.learning_rate, **r.fixed}
    if r.adam:
        kwargs.update(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    takes = _parameters(cls) if cls is not None else None
    if takes is None or "weight_decay" in takes:
        kwargs["weight_decay"] = t.weight_decay
    kwargs.update(t.optimizer_args)
    return kwargs


def _parameters(cls: type) -> set[str] | None:
    """The keyword arguments ``cls`` takes; None when it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) - {"self", "params"}


def check(cfg: "Config", where: Any, problems: list[str]) -> None:
    """Config checks: the name resolves; a dotted path is in a trusted module (or allowed) and names
    an optimizer class; ``optimizer_args`` are arguments the class takes. A known optimizer's class
    is imported only to check arguments, and only when its package is installed (a missing package
    is reported when training starts)."""
    t = cfg.train
    r = resolve(t.optimizer)
    if isinstance(r, str):
        problems.append(f"{where('train.optimizer')}: {r}")
        return
    if why := r.refusal(t.optimizer_allow_any):
        problems.append(f"{where('train.optimizer')}: {why}")
        return
    if "lr" in t.optimizer_args:
        problems.append(f"{where('train.optimizer_args')}: lr: set train.learning_rate instead (the schedule "
                        "scales it)")
    dotted = r.path == r.name  # a path the user wrote: what it names is known only once imported
    if not (t.optimizer_args or dotted) or not r.installed():
        return
    try:
        cls = r.load(t.optimizer_allow_any)
    except ImgloraError as exc:
        problems.append(f"{where('train.optimizer')}: {exc}")
        return
    takes = _parameters(cls)
    if takes is None:
        return
    for key in t.optimizer_args:
        if key not in takes:
            close = difflib.get_close_matches(key, sorted(takes), n=1, cutoff=0.6)
            hint = f' (did you mean "{close[0]}"?)' if close else f" (it takes {', '.join(sorted(takes))})"
            problems.append(f"{where('train.optimizer_args')}: {key}: not an argument of {r.path}{hint}")


def is_schedule_free(name: str) -> bool:
    r = resolve(name)
    return isinstance(r, Resolved) and r.module.split(".")[0] == "schedulefree"
