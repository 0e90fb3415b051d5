"""CUDA stand-ins for running the engine's CUDA code paths on a CPU-only build.

Two of them, one built on the other:

* :class:`FakeCuda` records the calls (streams, events, cudart) and nothing else: tests replay its
  log to check the event protocol (tests/memory/test_swap.py, test_swap_tune.py).
* :class:`AsyncCuda` *models* a GPU with streams: every aten op (seen through a TorchDispatchMode)
  runs on the current stream; a ``non_blocking`` copy issued on a side stream is *in flight* -- its
  bytes are not in the destination -- until a wait orders it before the reader (``wait_event`` on an
  event recorded after it, ``wait_stream``, ``synchronize``). Accesses are checked with vector
  clocks, so an ordering error is caught whatever the timing:

  - a kernel reading memory that a copy on another stream writes, with no wait in between
    ("read before its copy was waited on");
  - a write (a copy into a slot) to memory that a kernel queued earlier on another stream reads or
    writes, with no wait on an event recorded after that kernel ("overwritten while ... may still
    read it");
  - a kernel (anything but a copy) reading page-locked host memory: on a GPU that is a device
    mismatch, or a silent read over PCIe of a block that should have been swapped in.

  Violations are kept in :attr:`AsyncCuda.violations`; :meth:`AsyncCuda.check` raises listing them
  (the ``standin`` fixture of test_cuda_rehearsal.py calls it at the end of the test). Without
  fuzz a copy lands as late as allowed (at the wait that orders it); ``fuzz=seed`` gives each copy a
  random latency (a seeded number of ops, on any stream, after which it lands by itself), so which
  copies are complete at each wait and each kernel varies, as on a GPU.

Why not ``FakeTensorMode`` on ``cuda``: it fakes ``cuda:0`` tensors and checks device mixes, but on
this CPU-only build basic indexing (``t[a:b]``, used by the engine's slot views and everywhere in
diffusers) raises "PyTorch is not linked with support for cuda devices" (the C++ indexing path takes
a CUDA device guard), and fake tensors have no values, so training with swap on could not be
compared with training without it. Here the tensors are real CPU tensors; what is "device" and what
is host memory is the stand-in's bookkeeping (registered or pinned buffers are host memory).
"""

from __future__ import annotations

import itertools
import random
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass


class FakeCuda:
    """A recording stand-in for torch.cuda's streams, events and cudart (see its tests)."""

    def __init__(self, register_rc: int = 0) -> None:
        self.log: list[tuple] = []
        self.registered: set[int] = set()
        self.register_rc = register_rc
        fake = self

        class Event:
            def record(self, stream):
                fake.log.append(("record", self, stream))

        class Stream:
            def __init__(self, device=None, name: str = "copy") -> None:
                self.name = name

            def wait_event(self, event) -> None:
                fake.log.append(("wait", self, event))

            def wait_stream(self, other) -> None:
                fake.log.append(("wait_stream", self, other))

        class Cudart:
            @staticmethod
            def cudaHostRegister(ptr, size, flags):
                assert ptr not in fake.registered and size > 0 and flags == 1
                if fake.register_rc == 0:
                    fake.registered.add(ptr)
                return fake.register_rc

            @staticmethod
            def cudaHostUnregister(ptr):
                fake.registered.remove(ptr)
                return 0

        self.Event, self.Stream, self.Cudart = Event, Stream, Cudart
        self.compute = Stream(name="compute")
        self.current = [self.compute]

    @contextmanager
    def stream(self, s):
        self.current.append(s)
        try:
            yield
        finally:
            self.current.pop()

    def install(self, monkeypatch) -> None:
        import peft  # noqa: F401 - imported before torch.cuda is patched (it inspects torch.cuda types)

        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current[-1])
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append(("synchronize",)))
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self.Cudart)


# ------------------------------------------------------------------------------ the asynchronous model


class OrderingViolation(AssertionError):
    pass


@dataclass
class _Copy:
    """A non_blocking copy in flight: issued on ``stream`` as its op ``seq``; lands at :meth:`land`."""

    dst: torch.Tensor
    src: torch.Tensor
    stream: Any
    seq: int
    latency: int  # ops (on any stream) it stays in flight at most (fuzz); huge: until a wait orders it

    def land(self) -> None:
        # The copy was counted (autograd's version counter) when it was issued, as on a GPU; its
        # bytes arriving later is not another write.
        # Landing is the copy engine's work, not an op on any stream: the stream mode does not see it
        # (a wait outside any op lands copies too).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.dst), _disable_current_modes():
            self.dst.copy_(self.src)


@dataclass
class _History:
    write: tuple[Any, int, str] | None = None  # (stream, seq, op) of the last write
    reads: dict[Any, tuple[int, str]] = field(default_factory=dict)  # stream -> (seq, op) since that write


_NO_ACCESS = {"empty", "empty_strided", "empty_like", "is_pinned", "_pin_memory", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type", "record_stream",
              "set_", "lift_fresh", "detach"}
_COPIES = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "clone"}


def _leaves(obj: Any):
    """Plain tensors inside ``obj`` (lists, tuples, dicts; subclasses opened with __tensor_flatten__)."""
    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            for name in obj.__tensor_flatten__()[0]:
                yield from _leaves(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _leaves(o)


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    for a in (*args, kwargs.get("device")):
        if isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda")):
            return True
    return False


def _key(t: torch.Tensor) -> int | None:
    try:
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() else None
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: its inner tensors have storage
        return None


class AsyncCuda(FakeCuda):
    """torch.cuda for the engine, with asynchronous copies modelled and checked (module docstring).

    Install it for a test with :meth:`install` (monkeypatch) and run the code under :meth:`active`
    (the dispatch mode that puts every op on the current stream). ``fuzz``: a seed for random copy
    latencies; None lands every copy as late as allowed (at the wait that orders it).
    """

    def __init__(self, register_rc: int = 0, fuzz: int | None = None, max_latency: int = 60,
                 total_memory: int = 24 * 2**30) -> None:
        super().__init__(register_rc)
        fake = self
        # A failed runtime call is also CUDA's "last error" until cudaGetLastError reads it; PyTorch
        # checks that after every kernel launch, so the next kernel raises it (issue 22, defect 1).
        self.last_error: int | None = None
        self.rng = random.Random(fuzz) if fuzz is not None else None
        self.max_latency = max_latency
        self.violations: list[str] = []
        self.in_flight: list[_Copy] = []
        self.history: dict[int, _History] = {}
        self.host: dict[int, str] = {}  # storage key -> "registered" / "pinned"
        self.landed_early = 0  # copies landed by their fuzzed latency, before any wait ordered them
        self.total_memory = total_memory
        self.peak = self.allocated = 0
        self.clock = itertools.count()
        self.streams: list[Any] = []
        base_stream = self.Stream

        class Stream(base_stream):
            def __init__(self, device=None, name: str = "copy", priority: int = 0) -> None:
                super().__init__(device, name)
                self.count = 0  # ops issued on this stream
                self.vc: dict[Any, int] = {}  # stream -> its ops known complete before our next op
                fake.streams.append(self)

            def known(self, other: Any) -> int:
                return other.count if other is self else self.vc.get(other, 0)

            def wait_event(self, event) -> None:
                super().wait_event(event)
                if event.vc is not None:  # waiting on a never-recorded event is a no-op in CUDA
                    self._merge(event.vc)
                fake._waited()

            def wait_stream(self, other) -> None:
                super().wait_stream(other)
                self._merge({**other.vc, other: other.count})
                fake._waited()

            def _merge(self, vc: dict[Any, int]) -> None:
                for s, n in vc.items():
                    if s is not self and n > self.vc.get(s, 0):
                        self.vc[s] = n

            def synchronize(self) -> None:
                fake.synchronize()

            def query(self) -> bool:
                return not any(c.stream is self for c in fake.in_flight)

            def __repr__(self) -> str:
                return f"<{self.name} stream>"

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
                self.timing, self.t, self.vc, self.stream = enable_timing, None, None, None

            def record(self, stream=None):
                stream = stream if stream is not None else fake.current[-1]
                fake.log.append(("record", self, stream))
                self.vc, self.stream, self.t = {**stream.vc, stream: stream.count}, stream, next(fake.clock)

            def wait(self, stream=None):
                (stream if stream is not None else fake.current[-1]).wait_event(self)

            def synchronize(self) -> None:
                if self.vc is not None:
                    fake._land(lambda c: self.vc.get(c.stream, 0) >= c.seq)

            def query(self) -> bool:
                return self.vc is None or not any(self.vc.get(c.stream, 0) >= c.seq for c in fake.in_flight)

            def elapsed_time(self, end) -> float:
                assert self.timing and end.timing, "elapsed_time needs events made with enable_timing=True"
                assert self.t is not None and end.t is not None, "elapsed_time of an event never recorded"
                return float(end.t - self.t)

        base_cudart = self.Cudart

        class Cudart(base_cudart):
            @staticmethod
            def cudaHostRegister(ptr, size, flags):
                rc = base_cudart.cudaHostRegister(ptr, size, flags)
                if rc == 0:
                    fake.host[ptr] = "registered"
                else:
                    fake.last_error = rc
                return rc

            @staticmethod
            def cudaGetLastError():
                rc, fake.last_error = fake.last_error or 0, None
                return rc

            @staticmethod
            def cudaHostUnregister(ptr):
                fake.host.pop(ptr, None)
                return base_cudart.cudaHostUnregister(ptr)

        self.Stream, self.Event, self.Cudart = Stream, Event, Cudart
        self.compute = Stream(name="compute")
        self.current = [self.compute]

    # ---------------------------------------------------------------------------------- torch.cuda

    def install(self, monkeypatch) -> None:
        """torch.cuda is the stand-in's, and the product takes its CUDA code paths on CPU tensors
        (devices.REHEARSING_CUDA_ON_CPU)."""
        from imglora.util import devices

        super().install(monkeypatch)
        monkeypatch.setattr(devices, "REHEARSING_CUDA_ON_CPU", True)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])  # no device generator to save
        # The allocator's promise not to reuse a tensor's memory before a stream's queued work is done
        # (here the tensors stay alive while a copy in flight holds them): logged, for the tests.
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, stream: self.log.append(("record_stream", _key(t), stream)))
        # ``.to(device)`` of page-locked host memory is a host-to-device copy on a GPU; here the
        # "device" is the CPU, where ``.to`` would hand back the host tensor itself.
        real_to = torch.Tensor.to

        def to(t, *args, **kwargs):
            out = real_to(t, *args, **kwargs)
            if out is t and _key(t) in self.host and _names_a_device(args, kwargs):
                out = torch.empty_like(t, memory_format=torch.preserve_format)
                out.copy_(t)
                out.requires_grad_(t.requires_grad)
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)

        def pin_memory(t, device=None):  # a CPU-only build may refuse before the op is dispatched
            return self._pinned(t.clone())

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        props = type("Props", (), {"total_memory": self.total_memory, "name": "stand-in", "major": 9, "minor": 0,
                                   "multi_processor_count": 132})()
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset_peak)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def _reset_peak(self, device=None) -> None:
        self.peak = self.allocated

    def synchronize(self, device=None) -> None:
        self.log.append(("synchronize",))
        self._land(lambda c: True)
        for s in self.streams:
            for other in self.streams:
                if other is not s:
                    s.vc[other] = other.count

    @contextmanager
    def active(self):
        """Run the block with every op on the current stream (checked); the mode is left in place
        on exit only for the ``with`` body."""
        with _StreamMode(self):
            yield self

    def check(self) -> None:
        if self.violations:
            shown = "\n  ".join(self.violations[:8])
            more = f"\n  ... and {len(self.violations) - 8} more" if len(self.violations) > 8 else ""
            raise OrderingViolation(f"{len(self.violations)} CUDA ordering violation(s):\n  {shown}{more}")

    # ------------------------------------------------------------------------------- the model

    def _waited(self) -> None:
        """After any wait: land the copies now ordered before some stream's next op (they must have
        finished by then)."""
        self._land(lambda c: any(s.known(c.stream) >= c.seq for s in self.streams if s is not c.stream))

    def _tick(self) -> None:
        """Before each op (fuzz): the copies whose random latency ran out land by themselves."""
        def due(c: _Copy) -> bool:
            c.latency -= 1
            if c.latency == -1:
                self.landed_early += 1
            return c.latency < 0

        if self.rng is not None and self.in_flight:
            self._land(due)

    def _land(self, due) -> None:
        # a stream's copies finish in issue order: landing one lands the ones before it on its stream
        last: dict[Any, int] = {}
        for c in self.in_flight:
            if due(c):
                last[c.stream] = max(last.get(c.stream, 0), c.seq)
        keep = []
        for c in self.in_flight:
            if c.seq <= last.get(c.stream, 0):
                c.land()
            else:
                keep.append(c)
        self.in_flight = keep

    def _ordered(self, stream: Any, other: Any, seq: int) -> bool:
        return other is stream or stream.known(other) >= seq

    def _access(self, op: str, stream: Any, seq: int, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        for writing, tensors in ((False, reads), (True, writes)):
            for t in tensors:
                k = _key(t)
                if k is None:
                    continue
                h = self.history.setdefault(k, _History())
                if h.write is not None and not self._ordered(stream, h.write[0], h.write[1]):
                    what = (f"overwrites {self._what(k)} that {h.write[2]} on the {h.write[0].name} stream writes, "
                            "with no wait between them") if writing else (
                        f"reads {self._what(k)} that {h.write[2]} on the {h.write[0].name} stream writes: read "
                        "before its copy was waited on")
                    self.violations.append(f"{op} on the {stream.name} stream {what}")
                if writing:
                    self._overwrite(h, op, stream, seq, k)
                else:
                    h.reads[stream] = (seq, op)

    def _overwrite(self, h: Any, op: str, stream: Any, seq: int, k: int) -> None:
        """A write after reads queued on other streams: each must be ordered before it."""
        for other, (n, rop) in h.reads.items():
            if not self._ordered(stream, other, n):
                self.violations.append(
                    f"{op} on the {stream.name} stream overwrites {self._what(k)} while {rop} queued earlier "
                    f"on the {other.name} stream may still read it (no wait on an event recorded after it)")
        h.write, h.reads = (stream, seq, op), {}

    def _what(self, key: int) -> str:
        return f"{self.host[key]} host memory" if key in self.host else "device memory"

    def _pinned(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (just allocated) is page-locked memory from PyTorch's pinned allocator, until it is
        freed: then its address is ordinary memory again, whatever reuses it (allocations made
        outside any op, such as ``torch.tensor``'s, are not seen here)."""
        key = _key(out)
        self._fresh(key)
        self.host[key] = "pinned"
        weakref.finalize(out, self._unpinned, key)
        return out

    def _unpinned(self, key: int) -> None:
        if self.host.get(key) == "pinned":
            del self.host[key]

    def _fresh(self, key: int | None) -> None:
        """A new allocation at ``key``: whatever lived at this address before is gone (page-locked
        memory too: a pinned staging copy freed and its address reused by the CPU allocator)."""
        self.history.pop(key, None)
        self.host.pop(key, None)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = func._schema.name.split("::")[-1]
        stream = self.current[-1]
        self._tick()
        if name == "is_pinned":
            return _key(args[0]) in self.host
        if name == "_pin_memory":
            return self._pinned(args[0].clone())
        if kwargs.get("pin_memory"):
            return self._pinned(func(*args, **{**kwargs, "pin_memory": False}))
        if func is torch.ops.aten.copy_.default and stream is not self.compute and (
                len(args) > 2 and args[2] or kwargs.get("non_blocking")):
            dst, src = args[0], args[1]
            stream.count += 1
            self._access("a non_blocking copy", stream, stream.count, [src], [dst])
            latency = self.rng.randint(0, self.max_latency) if self.rng is not None else 2**62
            self.in_flight.append(_Copy(dst, src.detach(), stream, stream.count, latency))
            return dst
        if name in _NO_ACCESS or func.is_view:
            out = func(*args, **kwargs)
            if name.startswith("empty") or name == "lift_fresh":  # lift_fresh: torch.tensor's new memory
                for t in _leaves(out):
                    self._fresh(_key(t))
            return out
        if self.last_error is not None and name not in _COPIES:
            raise RuntimeError(f"CUDA error: error {self.last_error} (raised by the first kernel after a failed "
                               "runtime call: CUDA's last error was never cleared)")
        schema_args = func._schema.arguments
        reads, writes = [], []
        flat = list(zip(schema_args, args)) + [(a, kwargs[a.name]) for a in schema_args if a.name in kwargs]
        for a, v in flat:
            target = writes if a.alias_info is not None and a.alias_info.is_write else reads
            target.extend(_leaves(v))
        inputs = {_key(t) for t in reads + writes}
        if name not in _COPIES:
            for t in reads:
                if _key(t) in self.host:
                    self.violations.append(
                        f"{name} on the {stream.name} stream reads {self.host[_key(t)]} host memory as a kernel "
                        "argument (a device mismatch on a GPU: the block is not in a slot)")
        out = func(*args, **kwargs)
        fresh = [t for t in _leaves(out) if _key(t) not in inputs]
        for t in fresh:
            self._fresh(_key(t))
        stream.count += 1
        self._access(name, stream, stream.count, reads, writes + fresh)
        return out


class _StreamMode(TorchDispatchMode):
    def __init__(self, fake: AsyncCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.fake._dispatch(func, args, kwargs or {})
