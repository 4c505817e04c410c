"""Averaging round benchmark: the project's hivemind butterfly all-reduce vs torch.distributed gloo.

For each model size and group size N this averages fp32 pseudo-gradients shaped like the byte-level
GPT's parameters (seeded random values, one set per learner, weights 1..N) and reports:

* hivemind (``p2p_diloco.net.averaging.HivemindAveraging``): wall seconds of the whole round (matchmaking
  + all-reduce), seconds of the all-reduce alone (``AverageResult.allreduce_seconds``) and bytes each
  learner sent (``AverageResult.bytes_sent``, measured: protobuf messages of the all-reduce);
* gloo (``torch.distributed.all_reduce`` in N spawned processes): seconds of the all-reduce of one
  flattened tensor (Δ·w with w appended, then divided by the summed weight), and the bytes a ring
  all-reduce sends per rank, 2·(N−1)/N · payload, which is *computed*, not measured.

Both sides run one warm-up round that is not counted, then ``--rounds`` timed rounds; the tables
give medians. All traffic stays on 127.0.0.1. Every averaged result is checked against a float64
reference; for hivemind it also checks that all learners got bit-identical tensors.

Usage::

    python benchmarks/allreduce_bench.py --sizes small,medium,large --learners 2,3,4 --rounds 3 \
        --json runs/allreduce_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from p2p_diloco.config import AveragingConfig, ModelConfig  # noqa: E402
from p2p_diloco.train.models.registry import build_model  # noqa: E402

SIZES: dict[str, ModelConfig] = {
    "small": ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=64),
    "medium": ModelConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128),
    "large": ModelConfig(n_layer=6, n_head=8, n_embd=256, seq_len=256),
}
LOOPBACK = "127.0.0.1"
WARMUP_ROUNDS = 1


# ----------------------------------------------------------------------------------------------- data


def param_shapes(model_cfg: ModelConfig) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in build_model(model_cfg, seed=0).parameters()]


def make_deltas(shapes: list[tuple[int, ...]], learner: int, seed: int) -> list[torch.Tensor]:
    """Learner ``learner``'s fp32 pseudo-gradients: seeded, so gloo workers rebuild the same values."""
    gen = torch.Generator().manual_seed(seed * 1000 + learner)
    return [torch.randn(shape, generator=gen, dtype=torch.float32) * 1e-2 for shape in shapes]


def learner_weight(learner: int) -> float:
    return float(learner + 1)  # unequal weights, like token counts, so the weighting is exercised


def reference_average(shapes: list[tuple[int, ...]], n: int, seed: int) -> torch.Tensor:
    """Weighted mean of all learners' flattened deltas, in float64."""
    total = None
    for i in range(n):
        flat = torch.cat([d.flatten() for d in make_deltas(shapes, i, seed)]).double() * learner_weight(i)
        total = flat if total is None else total + flat
    return total / sum(learner_weight(i) for i in range(n))


def ring_bytes_per_rank(n: int, payload_bytes: int) -> float:
    return 2 * (n - 1) / n * payload_bytes


# ------------------------------------------------------------------------------------------- results


@dataclass
class Row:
    size: str
    params: int
    payload_bytes: int
    learners: int
    rounds: int
    hm_round_s: list[float] = field(default_factory=list)  # barrier release -> last learner returns
    hm_allreduce_s: list[float] = field(default_factory=list)  # max over learners of allreduce_seconds
    hm_bytes_sent: list[list[int]] = field(default_factory=list)  # per round, per learner
    hm_failures: int = 0
    hm_max_abs_err: float | None = None
    hm_identical: bool | None = None
    hm_setup_s: float | None = None
    hm_error: str | None = None
    gloo_allreduce_s: list[float] = field(default_factory=list)  # max over ranks
    gloo_bytes_computed: float | None = None
    gloo_max_abs_err: float | None = None
    gloo_error: str | None = None
    loadavg_1min_at_start: float | None = None  # other work on the machine skews the figures

    @staticmethod
    def _med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    def summary(self) -> dict:
        hm_bytes = [statistics.mean(b) for b in self.hm_bytes_sent if b]
        return {
            "hm_round_s_median": self._med(self.hm_round_s),
            "hm_allreduce_s_median": self._med(self.hm_allreduce_s),
            "hm_bytes_sent_mean_per_learner": statistics.mean(hm_bytes) if hm_bytes else None,
            "hm_bytes_sent_min": min((min(b) for b in self.hm_bytes_sent if b), default=None),
            "hm_bytes_sent_max": max((max(b) for b in self.hm_bytes_sent if b), default=None),
            "gloo_allreduce_s_median": self._med(self.gloo_allreduce_s),
        }


# ------------------------------------------------------------------------------------------- hivemind


class _Round:
    """One averaging round: N learner threads released together by a barrier."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.results: list = [None] * n
        self.t_start = [0.0] * n
        self.t_end = [0.0] * n

    def learner(self, i: int, averaging, deltas: list[torch.Tensor], version: int) -> None:
        from p2p_diloco.core.averaging_api import RoundFailed

        self.barrier.wait()
        self.t_start[i] = time.perf_counter()
        try:
            self.results[i] = averaging.average(deltas, learner_weight(i), {"peer": i}, version=version)
        except RoundFailed as e:
            self.results[i] = e
        self.t_end[i] = time.perf_counter()


def run_hivemind(
    row: Row, shapes: list[tuple[int, ...]], seed: int, dhts: list, version_base: int, cfg: AveragingConfig
) -> None:
    from p2p_diloco.net.averaging import HivemindAveraging

    n = row.learners
    template = [torch.zeros(s) for s in shapes]
    deltas = [make_deltas(shapes, i, seed) for i in range(n)]
    reference = reference_average(shapes, n, seed)
    avs: list = []
    try:
        started = time.perf_counter()
        for d in dhts:
            avs.append(HivemindAveraging(d, template, cfg, prefix=f"bench_{row.size}_{n}").start())
        row.hm_setup_s = time.perf_counter() - started

        for r in range(WARMUP_ROUNDS + row.rounds):
            rnd = _Round(n)
            threads = [
                threading.Thread(target=rnd.learner, args=(i, av, d, version_base + r), daemon=True)
                for i, (av, d) in enumerate(zip(avs, deltas, strict=True))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=cfg.round_timeout + cfg.allreduce_timeout + 30)
            if any(t.is_alive() for t in threads):
                raise RuntimeError(f"round {r}: a learner thread did not return")
            results, t_start, t_end = rnd.results, rnd.t_start, rnd.t_end
            failed = [res for res in results if not hasattr(res, "deltas")]
            label = "warm-up" if r < WARMUP_ROUNDS else f"round {r - WARMUP_ROUNDS + 1}/{row.rounds}"
            if failed:
                print(f"  hivemind {label}: {len(failed)} learner(s) failed: {failed[0]}", flush=True)
                if r >= WARMUP_ROUNDS:
                    row.hm_failures += 1
                continue
            if any(res.group_size != n for res in results):
                print(f"  hivemind {label}: group sizes {[res.group_size for res in results]}", flush=True)
            round_s = max(t_end) - min(t_start)
            allreduce_s = max(res.allreduce_seconds for res in results)
            print(f"  hivemind {label}: round {round_s:.3f}s, all-reduce {allreduce_s:.3f}s", flush=True)
            if r < WARMUP_ROUNDS:
                continue
            row.hm_round_s.append(round_s)
            row.hm_allreduce_s.append(allreduce_s)
            row.hm_bytes_sent.append([res.bytes_sent for res in results])
            flats = [torch.cat([t.flatten() for t in res.deltas]) for res in results]
            err = max(float((f.double() - reference).abs().max()) for f in flats)
            row.hm_max_abs_err = err if row.hm_max_abs_err is None else max(row.hm_max_abs_err, err)
            identical = all(torch.equal(flats[0], f) for f in flats[1:])
            row.hm_identical = identical if row.hm_identical is None else (row.hm_identical and identical)
    finally:
        for a in avs:
            a.shutdown()


# ----------------------------------------------------------------------------------------------- gloo


def _gloo_worker(rank: int, n: int, port: int, shapes, seed: int, rounds: int, queue) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n, init_method=f"tcp://{LOOPBACK}:{port}")
    try:
        deltas = make_deltas(shapes, rank, seed)
        w = learner_weight(rank)
        local = torch.cat([d.flatten() for d in deltas])
        buf = torch.empty(local.numel() + 1, dtype=torch.float32)
        times = []
        for r in range(WARMUP_ROUNDS + rounds):
            dist.barrier()
            t0 = time.perf_counter()
            torch.mul(local, w, out=buf[:-1])  # weighted sum, weight appended: one all-reduce per round
            buf[-1] = w
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            averaged = buf[:-1] / buf[-1]
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the round ends when the slowest rank is done
            if r >= WARMUP_ROUNDS:
                times.append(float(elapsed))
        if rank == 0:  # only small values go through the queue (the parent is blocked in join meanwhile)
            err = float((averaged.double() - reference_average(shapes, n, seed)).abs().max())
            queue.put({"times": times, "max_abs_err": err, "payload_bytes": buf.numel() * 4})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def run_gloo(row: Row, shapes: list[tuple[int, ...]], seed: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(
        _gloo_worker,
        args=(row.learners, _free_port(), shapes, seed, row.rounds, queue),
        nprocs=row.learners,
        join=True,
    )
    out = queue.get()
    row.gloo_allreduce_s = out["times"]
    row.gloo_bytes_computed = ring_bytes_per_rank(row.learners, out["payload_bytes"])
    row.gloo_max_abs_err = out["max_abs_err"]
    for i, t in enumerate(out["times"]):
        print(f"  gloo round {i + 1}/{row.rounds}: all-reduce {t:.4f}s", flush=True)


# --------------------------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown_table(rows: list[Row]) -> str:
    head = (
        "| model | params | payload MB | N | hivemind round s | hivemind all-reduce s "
        "| hivemind MB sent/learner (measured) | gloo all-reduce s | gloo MB sent/rank (computed, ring) "
        "| all-reduce hivemind/gloo | max abs err hivemind / gloo |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for row in rows:
        s = row.summary()
        ratio = (
            s["hm_allreduce_s_median"] / s["gloo_allreduce_s_median"]
            if s["hm_allreduce_s_median"] and s["gloo_allreduce_s_median"]
            else None
        )
        hm_mb = s["hm_bytes_sent_mean_per_learner"]
        hm_mb_txt = _fmt(hm_mb and hm_mb / 1e6, ".2f")
        if s["hm_bytes_sent_min"] is not None:
            lo, hi = f"{s['hm_bytes_sent_min'] / 1e6:.2f}", f"{s['hm_bytes_sent_max'] / 1e6:.2f}"
            hm_mb_txt += f" ({lo}–{hi})" if lo != hi else ""
        failures = f" ({row.hm_failures} failed)" if row.hm_failures else ""
        lines.append(
            f"| {row.size} | {row.params:,} | {row.payload_bytes / 1e6:.2f} | {row.learners} "
            f"| {_fmt(s['hm_round_s_median'], '.2f')}{failures} | {_fmt(s['hm_allreduce_s_median'], '.3f')} "
            f"| {hm_mb_txt} | {_fmt(s['gloo_allreduce_s_median'], '.4f')} "
            f"| {_fmt(row.gloo_bytes_computed and row.gloo_bytes_computed / 1e6, '.2f')} "
            f"| {_fmt(ratio, '.0f' if ratio and ratio >= 10 else '.1f')}{'×' if ratio else ''} "
            f"| {_fmt(row.hm_max_abs_err, '.1e')} / {_fmt(row.gloo_max_abs_err, '.1e')} |"
        )
    return head + "\n".join(lines) + "\n"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(comm, ppid, starttime) of a process from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, int(fields[1]), int(fields[19])


def our_p2pd_daemons() -> set[tuple[int, int]]:
    """(pid, starttime) of the p2pd daemons below this process: the ones our DHTs started."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) is not None:
            stats[int(entry)] = st
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if stats[child][0] == "p2pd":
                found.add((child, stats[child][2]))
    return found


def still_running(daemons: set[tuple[int, int]]) -> list[str]:
    alive = []
    for pid, started in sorted(daemons):
        st = _proc_stat(pid)
        if st is not None and st[0] == "p2pd" and st[2] == started:
            alive.append(f"p2pd pid {pid}")
    return alive


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium,large", help=f"comma list of {','.join(SIZES)}")
    p.add_argument("--learners", default="2,3,4", help="comma list of group sizes")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (after 1 warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matchmaking-time", type=float, default=2.0, help="AveragingConfig.matchmaking_time")
    p.add_argument(
        "--target-group-size",
        type=int,
        default=None,
        help="AveragingConfig.target_group_size (default: N, so a group assembles as soon as all N joined)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the raw figures here")
    p.add_argument("--skip-gloo", action="store_true")
    p.add_argument("--skip-hivemind", action="store_true")
    args = p.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    args.learners = [int(n) for n in args.learners.split(",") if n.strip()]
    if any(n < 2 for n in args.learners):
        p.error("--learners: group sizes must be >= 2")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def averaging_cfg(args: argparse.Namespace, n: int) -> AveragingConfig:
    target = n if args.target_group_size is None else max(n, args.target_group_size)
    return AveragingConfig(
        min_group_size=n,
        target_group_size=target,
        matchmaking_time=args.matchmaking_time,
        request_timeout=min(1.0, args.matchmaking_time / 2),
        round_timeout=30,
    )


def _git_revision() -> str:
    """Commit of the checkout being measured, with "+dirty" when p2p_diloco/ has local changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "p2p_diloco"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if rev.returncode == 0 else "unknown"


def _raise_on_sigterm(signum, frame):  # so the finally blocks below shut hivemind down
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    torch.set_num_threads(1)
    import hivemind

    daemons: set[tuple[int, int]] = set()  # p2pd daemons our DHTs started, checked at the end
    revision = _git_revision()
    print(f"p2p_diloco at {revision}", flush=True)
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} (1 min) on {os.cpu_count()} CPUs", flush=True)
    shapes = {s: param_shapes(SIZES[s]) for s in args.sizes}
    rows: list[Row] = []
    bench_started = time.perf_counter()
    version_base = 1
    for n in args.learners:
        dhts: list = []
        try:
            if not args.skip_hivemind:
                maddrs = [f"/ip4/{LOOPBACK}/tcp/0"]
                dhts.append(hivemind.DHT(start=True, host_maddrs=maddrs))
                for _ in range(n - 1):
                    peers = dhts[0].get_visible_maddrs()
                    dhts.append(hivemind.DHT(initial_peers=peers, host_maddrs=maddrs, start=True))
                daemons |= our_p2pd_daemons()
            for size in args.sizes:
                numel = sum(torch.Size(s).numel() for s in shapes[size])
                row = Row(size=size, params=numel, payload_bytes=numel * 4, learners=n, rounds=args.rounds)
                row.loadavg_1min_at_start = os.getloadavg()[0]
                rows.append(row)
                print(f"== {size} ({numel:,} params, {numel * 4 / 1e6:.2f} MB fp32), N={n}", flush=True)
                if not args.skip_hivemind:
                    try:
                        run_hivemind(row, shapes[size], args.seed, dhts, version_base, averaging_cfg(args, n))
                    except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
                        row.hm_error = f"{type(e).__name__}: {e}"
                        print(f"  hivemind error: {row.hm_error}", flush=True)
                    version_base += WARMUP_ROUNDS + args.rounds
                if not args.skip_gloo:
                    try:
                        run_gloo(row, shapes[size], args.seed)
                    except Exception as e:  # noqa: BLE001
                        row.gloo_error = f"{type(e).__name__}: {e}"
                        print(f"  gloo error: {row.gloo_error}", flush=True)
        finally:
            for d in dhts:
                try:
                    d.shutdown()
                except Exception as e:  # noqa: BLE001 - keep shutting the others down
                    print(f"DHT shutdown: {e!r}", file=sys.stderr)

    table = markdown_table(rows)
    print()
    print(table)
    total_s = time.perf_counter() - bench_started
    print(f"total wall time {total_s:.0f}s")
    time.sleep(1.0)  # give the daemons of the last DHTs a moment to exit
    left = still_running(daemons)
    if left:
        print(f"WARNING: p2pd started by this run still running: {', '.join(left)}", file=sys.stderr)
    else:
        print(f"no p2pd process left behind by this run ({len(daemons)} started and stopped)")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} (1 min)")
    if args.json:
        meta = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "p2p_diloco_revision": revision,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": hivemind.__version__,
            "warmup_rounds": WARMUP_ROUNDS,
            "matchmaking_time": args.matchmaking_time,
            "target_group_size": args.target_group_size or "N",
            "total_wall_s": total_s,
            "leftover_p2pd": left,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        }
        payload = {"meta": meta, "rows": [{**asdict(r), **r.summary()} for r in rows]}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
