"""Node health: read the GPUs and the host, decide what is wrong, and when to ask for a drain.

Three layers, in the order of this file:

- pure decisions: :func:`evaluate` turns readings into :class:`Finding` sentences and
  :class:`HealthTracker` turns a run of unhealthy checks into one :class:`DrainDecision`. No I/O,
  no clock: ``now`` is given;
- thin I/O: :class:`NvmlReader` (GPUs through NVML) and :func:`read_host` (disks and memory
  through psutil). Both block; never call them on the event loop;
- :class:`HealthMonitor` ties them together for the daemon's health loop: every read runs in a
  thread and is bounded by a timeout, and a read that hangs is itself a finding.

A node without NVML (no driver, no GPU, a CPU test machine) has no GPUs to watch: that is not a
failure. A node whose NVML is present but broken (version mismatch after a driver upgrade, no
permission) is unhealthy: its GPUs cannot be trusted to train.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import psutil

from understudy.common.config import HealthConfig
from understudy.common.errors import UnderstudyError

T = TypeVar("T")

#: Xid codes that mean the GPU (or its memory, bus, link or firmware) is no longer fit to train,
#: with the meaning NVIDIA's Xid catalogue gives them. Every one asks for a GPU reset, a node
#: reboot or service, never just a restart of the application, so the node should be drained.
#: Left out on purpose: Xids that the catalogue attributes mostly to the application (13 graphics
#: engine exception, 31 MMU fault, 43 GPU stopped processing, 45 preemptive cleanup): a buggy
#: training script must not drain every node it touches.
CRITICAL_XIDS: dict[int, str] = {
    48: "uncorrectable double-bit ECC error in GPU memory",
    63: "memory page retired or row marked for remapping; a GPU reset is needed to apply it",
    64: "memory page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained uncorrectable ECC error",
    95: "uncontained uncorrectable ECC error",
    119: "GSP firmware RPC timeout",
    120: "GSP firmware error",
}

#: A read of NVML or of the host that takes longer than this is a finding.
DEFAULT_READ_TIMEOUT = 5.0
#: Events drained from NVML per read; a GPU in an Xid storm must not keep one read busy forever.
MAX_EVENTS_PER_READ = 256
#: Findings named in a drain reason; the rest are counted. Keeps the drain record small.
MAX_REASON_FINDINGS = 5


class HealthError(UnderstudyError):
    """NVML is present but could not be initialised or could not list the GPUs."""


# ---------------------------------------------------------------------------------------------
# Readings and decisions (pure)


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    #: None: the device does not report it, or it could not be read (see ``read_errors``).
    temperature_c: float | None
    #: The temperature at which the GPU starts to slow itself down; None when not reported.
    slowdown_temperature_c: float | None
    #: Uncorrected ECC errors since the driver was loaded; None when ECC is off or unsupported.
    ecc_uncorrected_volatile: int | None
    #: Pre-Ampere page retirement: pages waiting for a reset to be retired.
    retired_pages_pending: bool | None
    #: Ampere and newer: a row remapping failed (the memory can no longer be repaired).
    remapped_rows_failure: bool | None
    #: Xid codes seen on this GPU since the reader was opened, each once, in order of first sight.
    xid_errors: tuple[int, ...] = ()
    #: Ampere and newer: rows waiting for a GPU reset to be remapped.
    remapped_rows_pending: bool | None = None
    #: "what: why" for each query NVML failed on (other than "not supported").
    read_errors: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})" if self.uuid else f"GPU {self.index}"


@dataclass(frozen=True)
class HostReading:
    #: Free space (for unprivileged users) of each configured path that could be read.
    disk_free_gib: dict[str, float]
    memory_available_mib: float
    #: Configured paths that could not be read (missing, no permission), with the reason.
    disk_errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    #: What the problem is about: "gpu:3", "disk:/data", "memory", "nvml", "host".
    subject: str
    #: One readable sentence, without a final period.
    problem: str


@dataclass(frozen=True)
class DrainDecision:
    #: One sentence naming the findings, for the drain request and the logs.
    reason: str
    findings: tuple[Finding, ...]
    #: ``now`` of the first check of the unhealthy streak.
    unhealthy_since: float


def evaluate(
    gpus: Sequence[GpuReading], host: HostReading | None, cfg: HealthConfig
) -> list[Finding]:
    """Everything wrong with these readings, in a stable order. ``host`` None: not read this
    time (the caller reports why). Pure: raises nothing for any reading."""
    findings: list[Finding] = []
    for gpu in gpus:
        findings += _gpu_findings(gpu, cfg)
    if host is not None:
        findings += _host_findings(host, cfg)
    return findings


def _gpu_findings(gpu: GpuReading, cfg: HealthConfig) -> list[Finding]:
    subject, label = f"gpu:{gpu.index}", gpu.label
    out = [Finding(subject, f"NVML could not read {label}: {err}") for err in gpu.read_errors]
    for code in dict.fromkeys(gpu.xid_errors):
        if code in CRITICAL_XIDS:
            out.append(Finding(subject, f"{label} reported Xid {code} ({CRITICAL_XIDS[code]})"))
    if gpu.ecc_uncorrected_volatile:
        out.append(Finding(subject, f"{label} has {gpu.ecc_uncorrected_volatile} uncorrected "
                                    "ECC error(s) since the driver was loaded"))
    if gpu.retired_pages_pending:
        out.append(Finding(subject, f"{label} has memory pages waiting to be retired; a GPU "
                                    "reset is needed"))
    if gpu.remapped_rows_pending:
        out.append(Finding(subject, f"{label} has memory rows waiting to be remapped; a GPU "
                                    "reset is needed"))
    if gpu.remapped_rows_failure:
        out.append(Finding(subject, f"{label} failed to remap a memory row; the GPU needs "
                                    "service"))
    if gpu.temperature_c is not None:
        limit: float | None
        if cfg.max_gpu_temperature_c is not None:
            limit, what = cfg.max_gpu_temperature_c, "health.max_gpu_temperature_c"
        else:
            limit, what = gpu.slowdown_temperature_c, "its slowdown threshold"
        if limit is not None and gpu.temperature_c >= limit:
            out.append(Finding(subject, f"{label} is at {gpu.temperature_c:g} °C, at or above "
                                        f"{what} of {limit:g} °C"))
    return out


def _host_findings(host: HostReading, cfg: HealthConfig) -> list[Finding]:
    out = []
    for path, reason in host.disk_errors.items():
        out.append(Finding(f"disk:{path}", f"disk path {path} cannot be checked: {reason}"))
    for path, free in host.disk_free_gib.items():
        if free < cfg.min_disk_free_gib:
            out.append(Finding(f"disk:{path}", f"disk {path} has {free:.1f} GiB free, below "
                                               f"health.min_disk_free_gib of "
                                               f"{cfg.min_disk_free_gib:g} GiB"))
    if host.memory_available_mib < cfg.min_memory_available_mib:
        out.append(Finding("memory", f"the host has {host.memory_available_mib:.0f} MiB of "
                                     f"memory available, below health.min_memory_available_mib "
                                     f"of {cfg.min_memory_available_mib:g} MiB"))
    return out


class HealthTracker:
    """Counts consecutive unhealthy checks and asks for a drain once per unhealthy streak.

    A check with findings extends the streak; a check without any ends it. The drain is asked
    on the ``failures_before_drain``-th check of a streak and never again in that streak: the
    drain request is already recorded, and asking again would only repeat it.
    """

    def __init__(self, failures_before_drain: int) -> None:
        if failures_before_drain < 1:
            raise ValueError(f"failures_before_drain must be at least 1, got "
                             f"{failures_before_drain!r}")
        self.failures_before_drain = failures_before_drain
        self.streak = 0
        self.unhealthy_since: float | None = None
        self.drain_asked = False

    def observe(self, findings: Sequence[Finding], now: float) -> DrainDecision | None:
        """Record one check's findings; return a decision when this check calls for a drain."""
        if not findings:
            self.streak, self.unhealthy_since, self.drain_asked = 0, None, False
            return None
        if self.unhealthy_since is None:
            self.unhealthy_since = now
        self.streak += 1
        if self.drain_asked or self.streak < self.failures_before_drain:
            return None
        self.drain_asked = True
        return DrainDecision(_reason(findings, self.streak, now - self.unhealthy_since),
                             tuple(findings), self.unhealthy_since)


def _reason(findings: Sequence[Finding], streak: int, duration: float) -> str:
    problems = list(dict.fromkeys(f.problem for f in findings))
    named = "; ".join(problems[:MAX_REASON_FINDINGS])
    if len(problems) > MAX_REASON_FINDINGS:
        named += f"; and {len(problems) - MAX_REASON_FINDINGS} more"
    if streak == 1:
        return f"a health check found: {named}"
    return f"{streak} consecutive health checks over {duration:.0f}s found: {named}"


# ---------------------------------------------------------------------------------------------
# I/O: NVML and the host (blocking)


class GpuSource(Protocol):
    """What :class:`HealthMonitor` reads GPUs from. ``read`` may block and raise HealthError."""

    def read(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    name: str
    xids: dict[int, None] = field(default_factory=dict)


class NvmlReader:
    """The GPUs of this node, read through NVML (the ``pynvml`` module of ``nvidia-ml-py``).

    Every method blocks on the driver, and a wedged driver can block for a long time: call them
    from a thread (``asyncio.to_thread``; :class:`HealthMonitor` uses a daemon thread with a
    timeout), never on the event loop. NVML itself is thread-safe; one reader is used by one
    thread at a time.

    Xids are events, not state: each :meth:`read` drains the events NVML queued since the last
    one, and a reading lists every Xid seen on its GPU since :meth:`open`. A critical Xid thus
    keeps the node unhealthy until the daemon is restarted, which an operator does after
    resetting or replacing the GPU.
    """

    def __init__(self, nvml: Any, gpus: list[_Gpu], event_set: Any) -> None:
        self._nvml = nvml
        self._gpus = gpus
        self._event_set = event_set
        self._closed = False

    @classmethod
    def open(cls) -> NvmlReader | None:
        """Initialise NVML and register for critical Xid events on every GPU.

        Returns None when NVML is absent (no library, no driver): there are no GPUs to watch.
        Raises HealthError when NVML is present but fails (version mismatch, no permission).
        """
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded, OSError):
            return None
        except pynvml.NVMLError as exc:
            raise HealthError(f"NVML could not be initialised: {exc}") from exc
        try:
            gpus = [_open_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise HealthError(f"NVML could not list the GPUs: {exc}") from exc
        return cls(pynvml, gpus, _register_xid_events(pynvml, gpus))

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    def read(self) -> list[GpuReading]:
        """Read every GPU. A query a device does not support gives None for its field; any
        other failure of a query is listed in the reading's ``read_errors``. Raises nothing."""
        self._drain_xids()
        return [self._read_gpu(gpu) for gpu in self._gpus]

    def close(self) -> None:
        """Release the event set and shut NVML down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        nvml = self._nvml
        if self._event_set is not None:
            _quiet(nvml, nvml.nvmlEventSetFree, self._event_set)
        _quiet(nvml, nvml.nvmlShutdown)

    def _drain_xids(self) -> None:
        nvml = self._nvml
        if self._event_set is None:
            return
        by_handle = {_address(g.handle): g for g in self._gpus}
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                event = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError_Timeout:
                return  # queue empty
            except nvml.NVMLError:
                # A lost GPU makes the wait fail; the per-device queries below report it.
                return
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                gpu = by_handle.get(_address(event.device))
                if gpu is not None:
                    gpu.xids[int(event.eventData)] = None

    def _read_gpu(self, gpu: _Gpu) -> GpuReading:
        nvml, h, errors = self._nvml, gpu.handle, []

        def query(what: str, fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(h, *args)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
                return None
            except nvml.NVMLError as exc:
                errors.append(f"{what}: {exc}")
                return None

        temp = query("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        slowdown = query("slowdown threshold", nvml.nvmlDeviceGetTemperatureThreshold,
                         nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        ecc = query("ECC errors", nvml.nvmlDeviceGetTotalEccErrors,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        pages = query("retired pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        rows = query("remapped rows", nvml.nvmlDeviceGetRemappedRows)
        return GpuReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            temperature_c=None if temp is None else float(temp),
            slowdown_temperature_c=None if slowdown is None else float(slowdown),
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            retired_pages_pending=None if pages is None else bool(pages),
            remapped_rows_failure=None if rows is None else bool(rows[3]),
            xid_errors=tuple(gpu.xids),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            read_errors=tuple(errors),
        )


def _open_gpu(nvml: Any, index: int) -> _Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    # Read once: identity does not change, and stays known after the GPU is lost.
    return _Gpu(index, handle, _text(nvml.nvmlDeviceGetUUID(handle)),
                _text(nvml.nvmlDeviceGetName(handle)))


def _register_xid_events(nvml: Any, gpus: list[_Gpu]) -> Any:
    """An event set with critical Xid events of every GPU that supports them, or None."""
    if not gpus:
        return None
    try:
        event_set = nvml.nvmlEventSetCreate()
    except nvml.NVMLError:
        return None
    for gpu in gpus:
        # Some devices (vGPU, some MIG setups) cannot deliver Xid events; their other
        # queries still work, so they are watched without Xids.
        _quiet(nvml, nvml.nvmlDeviceRegisterEvents, gpu.handle,
               nvml.nvmlEventTypeXidCriticalError, event_set)
    return event_set


def _quiet(nvml: Any, fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(nvml.NVMLError):
        fn(*args)


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def read_host(cfg: HealthConfig) -> HostReading:
    """Free disk space of ``cfg.disk_paths`` and available memory. A path that cannot be read
    is listed in ``disk_errors`` (and becomes a finding). Blocks on a hung mount; raises
    nothing."""
    free: dict[str, float] = {}
    errors: dict[str, str] = {}
    for path in cfg.disk_paths:
        try:
            free[path] = psutil.disk_usage(path).free / 2**30
        except OSError as exc:
            errors[path] = exc.strerror or str(exc)
    return HostReading(free, psutil.virtual_memory().available / 2**20, errors)


# ---------------------------------------------------------------------------------------------
# The monitor


class _Reopening:
    """Stands in for an NvmlReader whose open() failed: every read retries the open and raises
    its HealthError until NVML works (after a driver reload, say)."""

    def __init__(self) -> None:
        self._reader: NvmlReader | None = None

    def read(self) -> list[GpuReading]:
        if self._reader is None:
            self._reader = NvmlReader.open()
            if self._reader is None:
                return []  # the driver went away entirely: nothing to watch
        return self._reader.read()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


class _OffLoop(Generic[T]):
    """Runs one blocking call in a daemon thread, at most one at a time.

    A daemon thread, not ``asyncio.to_thread``: a call hung in the driver must not hold up the
    interpreter's exit, as a thread of an executor would. A call still running when the next
    check comes is waited on again instead of starting a second one, so a hang costs one thread.
    """

    def __init__(self, name: str, fn: Callable[[], T]) -> None:
        self.name = name
        self._fn = fn
        self._pending: asyncio.Future[T] | None = None
        self.started_at = 0.0

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    async def run(self, now: float, timeout: float) -> T:
        """The call's result. Raises TimeoutError when it has not returned within ``timeout``
        (it goes on in its thread), or what the call raised."""
        if self._pending is None:
            self._pending = self._start()
            self.started_at = now
        fut = self._pending
        await asyncio.wait({fut}, timeout=timeout)
        if not fut.done():
            raise TimeoutError
        self._pending = None
        return fut.result()

    def _start(self) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def deliver(setter: Callable[[Any], None], value: Any) -> None:
            if not fut.done():
                setter(value)

        def target() -> None:
            try:
                result = self._fn()
            except BaseException as exc:
                outcome: tuple[Callable[[Any], None], Any] = (fut.set_exception, exc)
            else:
                outcome = (fut.set_result, result)
            # RuntimeError: the loop is closed, and nobody waits for this answer any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, *outcome)

        # Mark an answer nobody collects (the monitor closed meanwhile) as seen, so asyncio does
        # not log it as "never retrieved".
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        threading.Thread(target=target, name=self.name, daemon=True).start()
        return fut


class HealthMonitor:
    """One health check per call of :meth:`check`: read, evaluate, track.

    Reads run off the event loop, each bounded by ``read_timeout``; a read that does not answer
    in time is a finding, and so is one still hanging at the next check.
    """

    def __init__(self, cfg: HealthConfig, gpus: GpuSource | None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, got {read_timeout!r}")
        self.cfg = cfg
        self.read_timeout = read_timeout
        self.tracker = HealthTracker(cfg.failures_before_drain)
        self._gpus = gpus
        self._gpu_call: _OffLoop[list[GpuReading]] = _OffLoop(
            "health-nvml", gpus.read if gpus is not None else lambda: [])
        self._host_call: _OffLoop[HostReading] = _OffLoop("health-host", lambda: read_host(cfg))
        self._closed = False

    @classmethod
    def open(cls, cfg: HealthConfig, read_timeout: float = DEFAULT_READ_TIMEOUT) -> HealthMonitor:
        """A monitor reading NVML when ``cfg.nvml`` is set and NVML is present. Blocks (NVML
        initialisation): call it from a thread. Raises nothing: a broken NVML is reported by
        every check until it works."""
        gpus: GpuSource | None = None
        if cfg.nvml:
            try:
                gpus = NvmlReader.open()
            except HealthError:
                gpus = _Reopening()
        return cls(cfg, gpus, read_timeout)

    async def check(self, now: float) -> tuple[list[Finding], DrainDecision | None]:
        """Read everything, evaluate, and return the findings with the drain decision of this
        check, if any. Takes at most about ``read_timeout`` seconds. Raises nothing for a failed
        or hung read."""
        (gpus, gpu_problems), (host, host_problems) = await asyncio.gather(
            self._read(self._gpu_call, "nvml", "NVML", now, []),
            self._read(self._host_call, "host", "the host's disk and memory check", now, None),
        )
        findings = gpu_problems + host_problems + evaluate(gpus, host, self.cfg)
        return findings, self.tracker.observe(findings, now)

    async def _read(self, call: _OffLoop[Any], subject: str, what: str, now: float,
                    default: Any) -> tuple[Any, list[Finding]]:
        was_busy = call.busy
        try:
            return await call.run(now, self.read_timeout), []
        except TimeoutError:
            if was_busy:
                problem = f"{what} has not answered for {now - call.started_at:.0f}s"
            else:
                problem = f"{what} did not answer within {self.read_timeout:g}s"
            return default, [Finding(subject, problem)]
        except UnderstudyError as exc:
            return default, [Finding(subject, str(exc))]

    def close(self) -> None:
        """Release NVML, unless a read is still hanging in it: shutting NVML down under a
        running call is unsafe, and the process is about to exit anyway. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._gpus is not None and not self._gpu_call.busy:
            self._gpus.close()
