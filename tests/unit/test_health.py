"""Health checks: pure rules and streak tracking, then the real NVML and psutil of this machine."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import threading
from pathlib import Path

import psutil
import pytest

from understudy.common.config import HealthConfig
from understudy.daemon.health import (
    CRITICAL_XIDS,
    DrainDecision,
    Finding,
    GpuReading,
    HealthError,
    HealthMonitor,
    HealthTracker,
    HostReading,
    NvmlReader,
    evaluate,
    read_host,
)

CFG = HealthConfig(min_disk_free_gib=1.0, disk_paths=("/", "/data"),
                   min_memory_available_mib=512.0, max_gpu_temperature_c=None)
HEALTHY_HOST = HostReading(disk_free_gib={"/": 100.0, "/data": 2.0}, memory_available_mib=4096.0)


def gpu(**changes: object) -> GpuReading:
    healthy = GpuReading(index=3, uuid="GPU-abc", name="NVIDIA H100", temperature_c=60.0,
                         slowdown_temperature_c=90.0, ecc_uncorrected_volatile=0,
                         retired_pages_pending=False, remapped_rows_failure=False, xid_errors=(),
                         remapped_rows_pending=False)
    return dataclasses.replace(healthy, **changes)


def problems(findings: list[Finding]) -> list[str]:
    return [f.problem for f in findings]


def nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# -- evaluate ----------------------------------------------------------------------------------


def test_healthy_readings_have_no_findings() -> None:
    unsupported = gpu(index=0, temperature_c=None, slowdown_temperature_c=None,
                      ecc_uncorrected_volatile=None, retired_pages_pending=None,
                      remapped_rows_failure=None, remapped_rows_pending=None)
    assert evaluate([gpu(), unsupported], HEALTHY_HOST, CFG) == []
    assert evaluate([], HEALTHY_HOST, CFG) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"xid_errors": (79,)}, "GPU 3 (GPU-abc) reported Xid 79 (GPU has fallen off the bus)"),
        ({"xid_errors": (48,)}, "GPU 3 (GPU-abc) reported Xid 48 (uncorrectable double-bit"),
        ({"ecc_uncorrected_volatile": 2}, "GPU 3 (GPU-abc) has 2 uncorrected ECC error(s)"),
        ({"retired_pages_pending": True}, "GPU 3 (GPU-abc) has memory pages waiting to be retired"),
        ({"remapped_rows_pending": True}, "GPU 3 (GPU-abc) has memory rows waiting to be remapped"),
        ({"remapped_rows_failure": True}, "GPU 3 (GPU-abc) failed to remap a memory row"),
        ({"temperature_c": 90.0},
         "GPU 3 (GPU-abc) is at 90 °C, at or above its slowdown threshold of 90 °C"),
        ({"temperature_c": 97.0}, "GPU 3 (GPU-abc) is at 97 °C"),
        ({"read_errors": ("temperature: GPU is lost",)},
         "NVML could not read GPU 3 (GPU-abc): temperature: GPU is lost"),
    ],
)
def test_each_gpu_rule_gives_one_finding(changes: dict[str, object], expected: str) -> None:
    findings = evaluate([gpu(**changes)], HEALTHY_HOST, CFG)
    assert len(findings) == 1, findings
    assert findings[0].subject == "gpu:3"
    assert findings[0].problem.startswith(expected)


def test_every_critical_xid_is_a_finding_and_others_are_not() -> None:
    for code, meaning in CRITICAL_XIDS.items():
        assert problems(evaluate([gpu(xid_errors=(code,))], None, CFG)) == [
            f"GPU 3 (GPU-abc) reported Xid {code} ({meaning})"
        ]
    # Application-caused Xids (graphics exception, MMU fault) do not make a node unhealthy.
    assert evaluate([gpu(xid_errors=(13, 31, 43))], None, CFG) == []
    # Repeated codes are reported once, in order of first sight.
    assert problems(evaluate([gpu(xid_errors=(94, 13, 79, 94))], None, CFG)) == [
        "GPU 3 (GPU-abc) reported Xid 94 (contained uncorrectable ECC error)",
        "GPU 3 (GPU-abc) reported Xid 79 (GPU has fallen off the bus)",
    ]


def test_the_own_slowdown_threshold_applies_only_without_a_configured_maximum() -> None:
    below = gpu(temperature_c=89.0)
    assert evaluate([below], None, CFG) == []
    no_threshold = gpu(temperature_c=120.0, slowdown_temperature_c=None)
    assert evaluate([no_threshold], None, CFG) == []

    capped = dataclasses.replace(CFG, max_gpu_temperature_c=80.0)
    assert problems(evaluate([gpu(temperature_c=80.0)], None, capped)) == [
        "GPU 3 (GPU-abc) is at 80 °C, at or above health.max_gpu_temperature_c of 80 °C"
    ]
    assert evaluate([gpu(temperature_c=79.5)], None, capped) == []
    # The configured maximum replaces the GPU's own threshold, also when it is higher.
    relaxed = dataclasses.replace(CFG, max_gpu_temperature_c=95.0)
    assert evaluate([gpu(temperature_c=92.0)], None, relaxed) == []
    assert evaluate([gpu(temperature_c=None)], None, capped) == []


def test_host_rules() -> None:
    host = HostReading(disk_free_gib={"/": 100.0, "/data": 0.25}, memory_available_mib=300.0,
                       disk_errors={"/scratch": "No such file or directory"})
    findings = evaluate([], host, CFG)
    assert findings == [
        Finding("disk:/scratch",
                "disk path /scratch cannot be checked: No such file or directory"),
        Finding("disk:/data",
                "disk /data has 0.2 GiB free, below health.min_disk_free_gib of 1 GiB"),
        Finding("memory", "the host has 300 MiB of memory available, below "
                          "health.min_memory_available_mib of 512 MiB"),
    ]
    at_minimum = HostReading(disk_free_gib={"/": 1.0}, memory_available_mib=512.0)
    assert evaluate([], at_minimum, CFG) == []


def test_findings_of_several_gpus_and_the_host_are_all_reported() -> None:
    host = dataclasses.replace(HEALTHY_HOST, memory_available_mib=1.0)
    findings = evaluate([gpu(index=0, uuid="GPU-0", xid_errors=(95,)),
                         gpu(index=1, uuid="GPU-1", ecc_uncorrected_volatile=1)], host, CFG)
    assert [f.subject for f in findings] == ["gpu:0", "gpu:1", "memory"]


# -- HealthTracker ---------------------------------------------------------------------------

BAD = [Finding("gpu:3", "GPU 3 (GPU-abc) reported Xid 79 (GPU has fallen off the bus)")]


def test_tracker_asks_for_a_drain_after_enough_consecutive_failures() -> None:
    tracker = HealthTracker(failures_before_drain=3)
    assert tracker.observe(BAD, now=100.0) is None
    assert tracker.observe(BAD, now=110.0) is None
    decision = tracker.observe(BAD, now=120.0)
    assert isinstance(decision, DrainDecision)
    assert decision.findings == tuple(BAD)
    assert decision.unhealthy_since == 100.0
    assert decision.reason == ("3 consecutive health checks over 20s found: GPU 3 (GPU-abc) "
                               "reported Xid 79 (GPU has fallen off the bus)")


def test_tracker_asks_once_per_streak() -> None:
    tracker = HealthTracker(failures_before_drain=2)
    decisions = [tracker.observe(BAD, now=float(t)) for t in range(10)]
    assert [d is not None for d in decisions] == [False, True] + [False] * 8


def test_a_healthy_check_resets_the_streak() -> None:
    tracker = HealthTracker(failures_before_drain=2)
    assert tracker.observe(BAD, now=0.0) is None
    assert tracker.observe([], now=1.0) is None
    assert tracker.observe(BAD, now=2.0) is None  # a new streak starts at one
    first = tracker.observe(BAD, now=3.0)
    assert first is not None and first.unhealthy_since == 2.0
    assert tracker.observe([], now=4.0) is None
    assert tracker.observe(BAD, now=5.0) is None
    second = tracker.observe(BAD, now=6.0)  # after a healthy check, a new streak drains again
    assert second is not None and second.unhealthy_since == 5.0


def test_tracker_with_one_failure_and_a_long_list_of_findings() -> None:
    tracker = HealthTracker(failures_before_drain=1)
    many = [Finding(f"gpu:{i}", f"problem {i}") for i in range(8)] + [Finding("gpu:0", "problem 0")]
    decision = tracker.observe(many, now=0.0)
    assert decision is not None
    assert decision.reason == ("a health check found: problem 0; problem 1; problem 2; "
                               "problem 3; problem 4; and 3 more")
    with pytest.raises(ValueError, match="failures_before_drain must be at least 1, got 0"):
        HealthTracker(failures_before_drain=0)


# -- I/O on this machine ----------------------------------------------------------------------


@pytest.mark.skipif(nvml_library_present(), reason="this machine has an NVIDIA driver")
def test_nvml_open_without_a_driver_means_no_gpus() -> None:
    assert NvmlReader.open() is None


def test_read_host_gives_plausible_numbers(tmp_path: Path) -> None:
    missing = "/nonexistent/understudy-health-test"
    cfg = dataclasses.replace(CFG, disk_paths=("/", str(tmp_path), missing))
    host = read_host(cfg)
    assert set(host.disk_free_gib) == {"/", str(tmp_path)}
    total_gib = psutil.disk_usage("/").total / 2**30
    assert 0 < host.disk_free_gib["/"] <= total_gib
    assert 0 < host.memory_available_mib <= psutil.virtual_memory().total / 2**20
    assert host.disk_errors == {missing: "No such file or directory"}
    assert [f.subject for f in evaluate([], host, cfg)] == [f"disk:{missing}"]


def test_monitor_on_this_machine_is_healthy_with_modest_minimums() -> None:
    if nvml_library_present():
        pytest.skip("this machine has an NVIDIA driver; its GPUs' health is not ours to know")
    cfg = HealthConfig(min_disk_free_gib=0.0, min_memory_available_mib=0.0)
    monitor = HealthMonitor.open(cfg)
    try:
        findings, decision = asyncio.run(monitor.check(now=0.0))
    finally:
        monitor.close()
    assert findings == []
    assert decision is None


def test_monitor_drains_a_node_whose_disk_is_too_small() -> None:
    cfg = HealthConfig(min_disk_free_gib=10**9, disk_paths=("/",), failures_before_drain=3)
    monitor = HealthMonitor.open(cfg)

    async def four_checks() -> list[tuple[list[Finding], DrainDecision | None]]:
        return [await monitor.check(now=10.0 * i) for i in range(4)]

    try:
        results = asyncio.run(four_checks())
    finally:
        monitor.close()
        monitor.close()  # idempotent
    for findings, _ in results:
        disk = [f for f in findings if f.subject == "disk:/"]
        assert len(disk) == 1
        assert "below health.min_disk_free_gib of 1e+09 GiB" in disk[0].problem
    decisions = [d for _, d in results]
    assert decisions[0] is None and decisions[1] is None and decisions[3] is None
    assert decisions[2] is not None
    assert decisions[2].unhealthy_since == 0.0
    assert decisions[2].reason.startswith("3 consecutive health checks over 20s found: disk / has")


class HangingGpus:
    """A GPU source whose read blocks until released, like NVML in a wedged driver."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed = False

    def read(self) -> list[GpuReading]:
        self.release.wait(timeout=30)
        return [gpu(xid_errors=(79,))]

    def close(self) -> None:
        self.closed = True


def test_a_hung_nvml_read_is_a_finding_and_is_not_started_twice() -> None:
    cfg = HealthConfig(min_disk_free_gib=0.0, min_memory_available_mib=0.0,
                       failures_before_drain=2)
    source = HangingGpus()
    monitor = HealthMonitor(cfg, source, read_timeout=0.1)

    async def scenario() -> list[tuple[list[Finding], DrainDecision | None]]:
        out = [await monitor.check(now=0.0), await monitor.check(now=10.0)]
        source.release.set()
        out.append(await monitor.check(now=20.0))
        return out

    try:
        first, second, third = asyncio.run(scenario())
    finally:
        source.release.set()
        monitor.close()
    assert first == ([Finding("nvml", "NVML did not answer within 0.1s")], None)
    assert second[0] == [Finding("nvml", "NVML has not answered for 10s")]
    assert second[1] is not None and "NVML has not answered for 10s" in second[1].reason
    # The hung read's answer arrives: the same call, not a second one piled up behind it.
    assert problems(third[0]) == ["GPU 3 (GPU-abc) reported Xid 79 (GPU has fallen off the bus)"]
    assert third[1] is None  # same streak: the drain was already asked
    assert source.closed


def test_a_failed_read_is_a_finding_and_close_skips_a_hanging_source() -> None:
    class Broken:
        def read(self) -> list[GpuReading]:
            raise HealthError("NVML could not list the GPUs: Unknown Error")

        def close(self) -> None:
            pass

    cfg = HealthConfig(min_disk_free_gib=0.0, min_memory_available_mib=0.0)
    monitor = HealthMonitor(cfg, Broken(), read_timeout=5)
    findings, _ = asyncio.run(monitor.check(now=0.0))
    assert findings == [Finding("nvml", "NVML could not list the GPUs: Unknown Error")]
    monitor.close()

    hanging = HangingGpus()
    monitor = HealthMonitor(cfg, hanging, read_timeout=0.05)
    try:
        asyncio.run(monitor.check(now=0.0))
        monitor.close()  # a read is still inside the source: it must not be shut under it
        assert not hanging.closed
    finally:
        hanging.release.set()
    with pytest.raises(ValueError, match="read_timeout must be positive"):
        HealthMonitor(cfg, None, read_timeout=0)


def test_monitor_without_nvml_reads_only_the_host() -> None:
    cfg = HealthConfig(nvml=False, min_disk_free_gib=0.0, min_memory_available_mib=10**12)
    monitor = HealthMonitor.open(cfg)
    try:
        findings, _ = asyncio.run(monitor.check(now=0.0))
    finally:
        monitor.close()
    assert [f.subject for f in findings] == ["memory"]


@pytest.mark.gpu
def test_nvml_reads_real_gpus() -> None:
    reader = NvmlReader.open()
    if reader is None:
        pytest.skip("no NVML on this machine")
    try:
        readings = reader.read()
        again = reader.read()  # draining an empty event queue does not block or fail
    finally:
        reader.close()
        reader.close()
    assert len(readings) == len(again) == reader.gpu_count
    if not readings:
        pytest.skip("NVML is present but sees no GPU")
    for r in readings:
        assert r.uuid.startswith(("GPU-", "MIG-")), r
        assert r.name
        assert r.read_errors == (), r
        if r.temperature_c is not None:
            assert 0 < r.temperature_c < 130
        if r.ecc_uncorrected_volatile is not None:
            assert r.ecc_uncorrected_volatile >= 0
