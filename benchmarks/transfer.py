"""State-transfer benchmark: ``send_state`` against raw point-to-point bandwidth at real sizes.

One command, two fresh processes on this machine joined by two 2-rank gloo groups (one for the
raw sends, one under a ``PairGroupTransport``), one thread of torch each. For each size of
state (default 64 MiB, 256 MiB, 1 GiB), the leaver holds a GPT-like model's parameters and its
Adam state (``model_state``: a few large matrices per layer, many small vectors, one 0-dim
``step`` tensor per parameter, an RNG state and plain values), and the joiner holds the same
tree with its own values, as a joiner that built its model does. Each round then measures, in
an order that rotates from round to round so that the machine's load hits all three alike:

- **raw**: one gloo ``send`` of the state's byte count from a preallocated buffer into a
  preallocated buffer, answered by a 1-byte ack, timed on the leaver;
- **into**: ``send_state`` -> ``receive_into`` (the joiner's tensors are written in place);
- **state**: ``send_state`` -> ``receive_state`` (the joiner allocates the state);
- **chunked**: raw again, but as messages of ``chunk_bytes`` each, every receive posted ahead
  and every send at once: what gloo itself does with the transfer's message sizes, without
  digests, manifest or the transport's threads (not the target's reference: that is raw).

A transfer's time is the leaver's ``TransferStats.seconds``: from the call to the joiner's
verdict, manifest and digests included, as in a migration. The ratio to raw is taken per
round (raw and the transfer of the same round) and summarised over the rounds.

**Memory.** Before each operation an end collects garbage, returns freed heap to the system
(``malloc_trim(0)``), resets its peak resident set (``echo 5 > /proc/self/clear_refs``) and
reads ``VmRSS``; after it, it reads ``VmHWM``, the peak resident set since the reset (the
kernel records the peak before any unmapping, so a buffer allocated and freed inside the
operation counts). Peak extra = ``VmHWM - VmRSS`` before, in bytes: everything the operation
touched beyond what the process already held, staging, receive buffers, manifest, threads'
stacks, allocator slack. For ``receive_state`` the tensors it allocates are the state itself,
not overhead: their bytes are subtracted. Raw's own figure is the method's noise floor.

Prints a table per size and writes JSON with the machine, the command, the configuration and
every sample. ``--profile`` runs cProfile around each end's ``send_state`` /
``receive_into`` at the largest size and prints the functions with the most own time.

    .venv/bin/python benchmarks/transfer.py [--sizes 64,256,1024] [--rounds N] [--smoke]
                                            [--chunk-bytes B] [--profile] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import gc
import multiprocessing as mp
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import MIB, BenchmarkError, Table, summarize

from understudy.common.errors import UnderstudyError
from understudy.worker.transfer.ends import reset_peak, resident_bytes

KINDS = ("raw", "into", "state", "chunked")
LABELS = {"raw": "raw send + 1-byte ack", "into": "send_state -> receive_into",
          "state": "send_state -> receive_state", "chunked": "raw in chunk_bytes messages"}
#: Design target (/work/shared/design.md, "Targets").
TARGET_FRACTION = 0.70
LAYERS = 12
POSITIONS = 256


# -- the state ---------------------------------------------------------------------------------


def model_shapes(nbytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-like model's parameter shapes whose parameters and Adam state (three float32
    copies) come to about ``nbytes``: ``LAYERS`` layers of width ``d`` (about 70 % of the
    parameters in their matrices), the vocabulary taking the rest."""
    params = max(1, nbytes // 12)
    d = 8
    while LAYERS * 12 * (d + 8) ** 2 <= 0.7 * params:
        d += 8
    layer = [("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
             ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
             ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
             ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
             ("mlp.fc.weight", (4 * d, d)), ("mlp.fc.bias", (4 * d,)),
             ("mlp.proj.weight", (d, 4 * d)), ("mlp.proj.bias", (d,))]
    rest = params - LAYERS * (12 * d * d + 13 * d) - POSITIONS * d - 2 * d
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (max(1, rest // d), d)),
                                                 ("wpe.weight", (POSITIONS, d))]
    shapes += [(f"h.{i}.{name}", shape) for i in range(LAYERS) for name, shape in layer]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def model_state(nbytes: int, seed: int | None) -> dict[str, Any]:
    """``{"model": state_dict, "optim": Adam's state_dict, "rng", "step"}`` of about
    ``nbytes``; random values from ``seed``, or zeros (every page touched either way)."""
    import torch

    g = torch.Generator().manual_seed(seed or 0)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape)
        return t.normal_(generator=g) if seed is not None else t.zero_()

    shapes = model_shapes(nbytes)
    model = collections.OrderedDict((name, tensor(shape)) for name, shape in shapes)
    optim = {
        "state": {i: {"step": torch.tensor(1000.0), "exp_avg": tensor(shape),
                      "exp_avg_sq": tensor(shape).abs_()} for i, (_, shape) in enumerate(shapes)},
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                          "amsgrad": False, "maximize": False, "foreach": None,
                          "capturable": False, "differentiable": False, "fused": None,
                          "params": list(range(len(shapes)))}],
    }
    return {"model": model, "optim": optim, "rng": torch.get_rng_state(), "step": 1000,
            "data": {"epoch": 3, "position": 123_456}}


def tensor_bytes(state: Any, under: int | None = None) -> tuple[int, int]:
    """(bytes, count) of the tensors in ``state`` (``under``: of those smaller than that)."""
    from understudy.worker.transfer import _tensors_by_path

    sizes = [t.numel() * t.element_size() for t in _tensors_by_path(state).values()]
    sizes = [n for n in sizes if under is None or n < under]
    return sum(sizes), len(sizes)


# -- memory ------------------------------------------------------------------------------------


_LIBC = ctypes.CDLL("libc.so.6")


def _resident() -> tuple[int, int]:
    """``VmRSS`` and ``VmHWM`` as the workers read them (``worker.transfer``'s
    ``resident_bytes``); an error where /proc cannot say."""
    rss, peak = resident_bytes()
    if not rss:
        raise BenchmarkError("/proc/self/status gives no VmRSS: this benchmark needs Linux")
    return rss, peak


def settle() -> int:
    """Release what can be released, reset the peak resident set; the resident set now."""
    gc.collect()
    _LIBC.malloc_trim(0)
    if not reset_peak():
        raise BenchmarkError("/proc/self/clear_refs refuses to reset the peak resident set: "
                             "this benchmark needs Linux 4.0 or later")
    return _resident()[0]


def peak_since(before: int) -> int:
    return _resident()[1] - before


def _cpu_seconds() -> float:
    """CPU time of this process, every thread, user and system (gloo's copies run in the
    kernel, on its threads)."""
    return time.process_time()


# -- the two ends ------------------------------------------------------------------------------


def _peer(rank: int, store_path: str, cfg: dict[str, Any], results: Any) -> None:
    """One end (rank 0 the leaver, rank 1 the joiner): every size, every round, every kind."""
    try:
        results.put((rank, _measure(rank, store_path, cfg)))
    except Exception as exc:  # the parent reports it; a child has nobody else to tell
        import traceback

        results.put((rank, {"error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()}))


def _measure(rank: int, store_path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    import torch

    from understudy.worker.transfer import (
        DEFAULT_CHUNK_BYTES,
        receive_into,
        receive_state,
        send_state,
    )

    torch.set_num_threads(1)
    leaver = rank == 0
    raw, transport = harness.gloo_pair(store_path, rank, timeout_s=120)
    chunk_bytes = cfg["chunk_bytes"] or DEFAULT_CHUNK_BYTES
    one = torch.zeros(1, dtype=torch.uint8)

    out: dict[str, Any] = {"sizes": {}, "chunk_bytes": chunk_bytes}
    profile_at = cfg["sizes"][-1] if cfg["profile"] else None
    for mib in cfg["sizes"]:
        state = model_state(mib * MIB, seed=rank)
        nbytes, count = tensor_bytes(state)
        buf = torch.ones(nbytes, dtype=torch.uint8)
        pieces = list(buf.split(chunk_bytes))
        # The plan packs tensors under chunk_bytes // 8 into staged chunks (wire.py, _plan).
        small_bytes, small_count = tensor_bytes(state, under=chunk_bytes // 8)
        size: dict[str, Any] = {"bytes": nbytes, "tensors": count, "small_bytes": small_bytes,
                                "small_tensors": small_count, "stats": {},
                                "loadavg_1m": [os.getloadavg()[0]]}
        size.update({k: {"seconds": [], "cpu_seconds": [], "extra_bytes": []} for k in KINDS})
        profiler = cProfile.Profile() if mib == profile_at else None
        for r in range(cfg["warmup"] + cfg["rounds"]):
            order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
            for kind in order:
                before = settle()
                # both ends ready (their memory settled) before the clock starts
                harness.round_trip(raw, rank, [one], one, tags=(1, 2))
                cpu = _cpu_seconds()
                start = time.perf_counter()
                fresh = 0
                if kind in ("raw", "chunked"):
                    harness.round_trip(raw, rank, [buf] if kind == "raw" else pieces, one)
                    seconds = time.perf_counter() - start
                else:
                    if profiler is not None and kind == "into":
                        profiler.enable()
                    if leaver:
                        stats = send_state(transport, state, chunk_bytes=chunk_bytes)
                        seconds = stats.seconds
                    elif kind == "into":
                        _, stats = receive_into(transport, state)
                        seconds = stats.seconds
                    else:
                        got, stats = receive_state(transport)
                        seconds = stats.seconds
                        fresh = tensor_bytes(got)[0]  # the state itself, not overhead
                        del got
                    if profiler is not None:
                        profiler.disable()
                    size["stats"][kind] = dataclasses.asdict(stats)  # the last round's
                cpu = _cpu_seconds() - cpu
                extra = peak_since(before) - fresh
                if r >= cfg["warmup"]:
                    size[kind]["seconds"].append(seconds)
                    size[kind]["cpu_seconds"].append(cpu)
                    size[kind]["extra_bytes"].append(extra)
        size["loadavg_1m"].append(os.getloadavg()[0])
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            size["profile"] = text.getvalue()
        out["sizes"][str(mib)] = size
        del state, buf, pieces
    transport.close()
    return out


def measure(cfg: dict[str, Any], base: Path) -> dict[str, Any]:
    """Both ends' figures, by rank.

    Raises:
        BenchmarkError: an end failed or ran past its time.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = base / "store"
    peers = [ctx.Process(target=_peer, name=f"transfer-{r}",
                         args=(r, str(store), cfg, results)) for r in (0, 1)]
    for p in peers:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    # Per round and GiB: three transfers of about a second; building the state, seconds more.
    budget = 120 + sum(cfg["sizes"]) / 1024 * (cfg["rounds"] + cfg["warmup"]) * 30
    try:
        while len(got) < 2:
            try:
                rank, res = results.get(timeout=budget)
            except queue.Empty as exc:
                raise BenchmarkError(f"the transfer ends gave no result in {budget:.0f}s") \
                    from exc
            if "error" in res:
                raise BenchmarkError(f"end {rank} failed: {res['error']}\n{res['traceback']}")
            got[rank] = res
    finally:
        for p in peers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return {"leaver": got[0], "joiner": got[1]}


# -- the figures -------------------------------------------------------------------------------


def collect(ends: dict[str, Any]) -> dict[str, Any]:
    leaver, joiner = ends["leaver"]["sizes"], ends["joiner"]["sizes"]
    out: dict[str, Any] = {}
    for label, s in leaver.items():
        j = joiner[label]
        raw = s["raw"]["seconds"]
        fig: dict[str, Any] = {"bytes": s["bytes"], "tensors": s["tensors"],
                               "small_bytes": s["small_bytes"],
                               "small_tensors": s["small_tensors"],
                               "stats": {"leaver": s["stats"], "joiner": j["stats"]},
                               "loadavg_1m_leaver": s["loadavg_1m"]}
        for kind in KINDS:
            secs = s[kind]["seconds"]
            fig[kind] = {
                "seconds": summarize(secs),
                "mb_per_s": s["bytes"] / summarize(secs)["median"] / 1e6,
                "joiner_seconds": summarize(j[kind]["seconds"]),
                "cpu_seconds_both_ends": summarize(
                    [a + b for a, b in zip(s[kind]["cpu_seconds"], j[kind]["cpu_seconds"],
                                           strict=True)]),
                "leaver_extra_bytes": summarize([float(x) for x in s[kind]["extra_bytes"]]),
                "joiner_extra_bytes": summarize([float(x) for x in j[kind]["extra_bytes"]]),
            }
            if kind != "raw":
                fig[kind]["ratio_to_raw"] = summarize(
                    [r / t for r, t in zip(raw, secs, strict=True)])
        out[label] = fig
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"\nState transfer against raw gloo point-to-point, {cfg['rounds']} rounds per size "
          f"after {cfg['warmup']} warm-up, chunk_bytes {result['chunk_bytes']}; the leaver's "
          f"clock")
    table = Table(label_width=44, repeats=cfg["rounds"])
    for label, fig in result["summary"].items():
        load = fig["loadavg_1m_leaver"]
        table.header(f"{int(label)} MiB: {fig['bytes']:,} B in {fig['tensors']} tensors "
                     f"(load {load[0]:.1f} -> {load[1]:.1f})")
        for kind in KINDS:
            table.row(f"{LABELS[kind]} ({fig[kind]['mb_per_s']:,.0f} MB/s)",
                      fig[kind]["seconds"], "ms", 1e3, ".1f")
        for kind in KINDS[1:]:
            table.row(f"{kind} / raw, per round", fig[kind]["ratio_to_raw"], "", 1, ".3f")
        for kind in KINDS:
            table.row(f"CPU time, both ends, {kind}", fig[kind]["cpu_seconds_both_ends"], "ms",
                      1e3, ".1f")
        for kind in KINDS:
            for end in ("leaver", "joiner"):
                table.row(f"peak extra memory, {end}, {kind}", fig[kind][f"{end}_extra_bytes"],
                          "MiB", 1 / MIB, ".1f")
        sent = fig["stats"]["leaver"]["into"]
        print(f"  {fig['small_tensors']} tensors under chunk_bytes/8 hold {fig['small_bytes']:,} B "
              f"(packed into staged chunks); {sent['chunks']} chunks, {sent['direct_chunks']} "
              f"straight from the leaver's tensors; peak staging {sent['peak_staging_bytes']:,} B "
              f"(leaver), {fig['stats']['joiner']['into']['peak_staging_bytes']:,} B (joiner)")
    for end in ("leaver", "joiner"):
        prof = result["profile"].get(end)
        if prof:
            print(f"\ncProfile of the {end}'s transfers (into) at the largest size, by own "
                  f"time:\n{prof}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("transfer", __doc__.splitlines()[0])
    p.add_argument("--sizes", help="state sizes in MiB, comma-separated (default 64,256,1024; "
                   "smoke 1,4)")
    p.add_argument("--rounds", type=int, help="measured rounds per size (default 11; smoke 2)")
    p.add_argument("--warmup", type=int, help="rounds left out per size (default 1; smoke 1)")
    p.add_argument("--chunk-bytes", type=int, default=0,
                   help="send_state's chunk_bytes (default: the library's)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile each end's send_state / receive_into at the largest size")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs(keep="keep the rendezvous file here")
    args = p.parse(argv, {"sizes": ("64,256,1024", "1,4"), "rounds": (11, 2), "warmup": (1, 1)})
    try:
        args.sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes takes MiB as integers, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--sizes must be >= 1 MiB, --rounds >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = {"sizes": args.sizes, "rounds": args.rounds, "warmup": args.warmup,
           "chunk_bytes": args.chunk_bytes, "profile": args.profile, "smoke": args.smoke}
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-xfer-")
    ends = scratch.run("transfer benchmark", (OSError, UnderstudyError),
                       lambda: measure(cfg, scratch.base))
    if isinstance(ends, int):
        return ends
    result = {
        **harness.header("transfer", scratch.started, torch=True),
        "config": {**cfg, "threads_per_process": 1, "layers": LAYERS,
                   "target_fraction": TARGET_FRACTION},
        "chunk_bytes": ends["leaver"]["chunk_bytes"],
        "summary": collect(ends),
        "profile": {end: next((s["profile"] for s in ends[end]["sizes"].values()
                               if "profile" in s), "") for end in ("leaver", "joiner")},
        "samples": {end: {label: {k: s[k] for k in KINDS}
                          for label, s in ends[end]["sizes"].items()}
                    for end in ("leaver", "joiner")},
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
