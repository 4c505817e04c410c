"""Swarm size, extrapolated: round time, bytes, DHT traffic and failure exposure at M = 100 ... 10,000.

An analytical model fitted to the per-peer costs that ``benchmarks/scale_swarm.py`` measured at M = 4, 8
and 16 learners (and the all-reduce figures of ``benchmarks/allreduce_bench.py``), plus a small seeded
Monte-Carlo of failures. It compares two designs (docs/scale.md, "Decisions for large swarms"):

- **baseline**, today's: one butterfly all-reduce group of all M learners (hivemind matchmaking with
  ``target_group_size`` = M); every learner's progress record is a subkey of one DHT key, so every read
  returns all M records.
- **two-level**, the chosen one: groups of g (G = ceil(M / g) groups, mean size M / G); reduce-scatter
  inside each group, a butterfly all-reduce of each shard across the G groups (member k of every group
  for shard k), all-gather inside each group; one DHT key per learner plus an index of who is live.

What is fitted (least squares on the 3 measured points; each fit's form, residuals and its error when
fitted on the smaller M alone and extrapolated to the largest are printed):

- matchmaking time (mean and p90) and commit-certificate time as functions of the group size n: the form
  among a + b·n, a + b·n·log2 n, a + b·n² and a·n^b that extrapolates best from the smaller M to the
  largest (the measurements at 8 and 16 formed groups smaller than M, see the check table, so "n" is
  ``target_group_size`` = M, the group that was asked for);
- all-reduce time = 2(n − 1)·ℓ + bytes sent / ρ (a butterfly of n: each learner exchanges n − 1 parts in
  the reduce-scatter and n − 1 in the all-gather; ℓ is a per-part overhead, ρ a per-learner rate), fitted
  to allreduce_bench.py's 9 runs (2-4 learners, 0.55-20 MB);
- DHT calls per learner per round = a + b·log2 M (Kademlia lookups take ~log M hops; the measured
  growth may also come from longer rounds), and protobuf KB per call = c0 + κ·(records one read returns):
  M in the baseline, 1 in the two-level design; κ lumps the record's size and the share of calls that
  read the records (the data cannot separate them);
- resident memory per learner: a constant (the mean); the slope per peer is printed but not used.

What is assumed (not measured):

- per-peer costs stay as measured on one 2-core machine over loopback (CPU-starved at M = 16); a WAN
  changes ℓ and ρ (``--message-seconds``, ``--rate-mb-s``);
- two-level: each group forms like a hivemind group of its size (the fit at n = M / G); the cross-group
  step starts when the slowest of the G groups has formed (E[max of G] normal formation times with the
  fitted mean and p90); the group certificates (g signatures of ``--signature-bytes``) are passed to the
  G − 1 counterparts; the index of live learners (``--index-entry-bytes`` per learner) is read in full once
  per round (counted at both ends, as traffic.py counts); one round per version, with as many DHT calls per
  round as the fit says at that M;
- certificate KB: the signatures a learner collects per round, of ``--signature-bytes`` each: all M today
  (through the DHT: already inside the baseline's DHT figure), a majority (M // 2 + 1) in the two-level design;
- failures: every learner dies or stalls as a Poisson process of ``--failures-per-hour``. A baseline round
  fails when any of its M members fails during the round. A two-level round of a group fails when one of
  its members fails during the round, or (as the design is written: a cross-group step that did not
  include the same groups for every shard fails for everyone) any other learner fails during the
  cross-group step: the union of the G counterparts of the group's g shards is every learner. The last
  column assumes instead that the cross-group step can drop a failed group from every shard consistently.
  The Monte-Carlo draws every learner's failure time and checks the analytic union of these exposures; it
  does not test the exposure model itself.

    .venv/bin/python benchmarks/scale_sim.py --learners 4 8 16 100 1000 10000 --group-size 16 \\
        --failures-per-hour 0.1 --json benchmarks/results/scale_sim_DATE_COMMIT.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------
# Measured inputs. Used when no benchmarks/results/scale_*.json (scale_swarm.py's --json output) is found or
# given with --measured; the figures are that run's JSON (/tmp/scale1.json), BENCHMARKS.md "Swarm size".
MEASURED_SOURCE = {
    "command": "python benchmarks/scale_swarm.py --learners 4 8 16 --outer-steps 5 --extra-step-seconds 0.1 "
               "--workdir /tmp/scale1 --json /tmp/scale1.json",
    "commit": "3f29ff4", "date": "2026-12-02",
    "setting": "2 CPU cores, loopback, peers/small-cpu.toml (136,960 fp32 parameters, H = 30), "
               "target_group_size = M, quorum K = 2",
}
MEASURED_DEFAULT: tuple[dict, ...] = (
    {"learners": 4, "group_sizes": [4, 4, 4, 4, 4], "full_fraction": 1.0,
     "matchmaking_seconds_mean": 0.44975, "matchmaking_seconds_p90": 1.009,
     "round_seconds_mean": 0.8869, "round_seconds_p90": 1.359, "allreduce_seconds_mean": 0.2281,
     "rss_mb_per_learner_mean": 864.72, "dht_calls_per_learner_per_version": 212.35,
     "dht_kb_per_learner_per_version": 394.10},
    {"learners": 8, "group_sizes": [4, 4, 4, 4, 4], "full_fraction": 0.0,
     "matchmaking_seconds_mean": 2.37595, "matchmaking_seconds_p90": 3.779,
     "round_seconds_mean": 3.36665, "round_seconds_p90": 4.932, "allreduce_seconds_mean": 0.4141,
     "rss_mb_per_learner_mean": 872.44, "dht_calls_per_learner_per_version": 452.5,
     "dht_kb_per_learner_per_version": 1430.64},
    {"learners": 16, "group_sizes": [2, 2, 2, 3, 3], "full_fraction": 0.0,
     "matchmaking_seconds_mean": 8.89335, "matchmaking_seconds_p90": 14.393,
     "round_seconds_mean": 14.5877, "round_seconds_p90": 21.61, "allreduce_seconds_mean": 2.19305,
     "rss_mb_per_learner_mean": 876.09, "dht_calls_per_learner_per_version": 713.78,
     "dht_kb_per_learner_per_version": 4609.67},
)
# allreduce_bench.py, used when benchmarks/results/allreduce_bench.json is missing: (learners, bytes sent per
# learner, median all-reduce seconds) of hivemind's butterfly over loopback on the same 2-core machine.
ALLREDUCE_SOURCE = {
    "command": "python benchmarks/allreduce_bench.py --sizes small,medium,large --learners 2,3,4 --rounds 3 "
               "--json benchmarks/results/allreduce_bench.json",
    "commit": "b684ce3", "date": "2026-11-30",
}
ALLREDUCE_DEFAULT: tuple[tuple[int, float, float], ...] = (
    (2, 548646.5, 0.06706), (2, 3502541.5, 0.13152), (2, 19745396.5, 0.45074),
    (3, 731544.7, 0.12043), (3, 4670071.3, 0.39228), (3, 26327211.3, 0.71333),
    (4, 823005.8, 0.17326), (4, 5253848.3, 0.28639), (4, 29618130.8, 0.92391),
)
GRADIENT_BYTES = 136_960 * 4  # the small model's outer gradient, fp32
# Assumptions (not measured):
SIGNATURE_BYTES = 730  # one commit signature: OpenSSH RSA-2048 public key (~380 B) + base64 signature (344 B)
INDEX_ENTRY_BYTES = 64  # one learner in the index of live learners: peer id, version, status
# ---------------------------------------------------------------------------------------------------------------

MEASURED_KEYS = ("learners", "matchmaking_seconds_mean", "matchmaking_seconds_p90", "round_seconds_mean",
                 "allreduce_seconds_mean", "rss_mb_per_learner_mean", "dht_calls_per_learner_per_version",
                 "dht_kb_per_learner_per_version")

FORMS: dict[str, Callable[[float], float]] = {
    "linear": lambda n: n,
    "nlogn": lambda n: n * math.log2(n),
    "quadratic": lambda n: n * n,
    "log": math.log2,
}
FORMULAS = {"linear": "{a} + {b}·n", "nlogn": "{a} + {b}·n·log2 n", "quadratic": "{a} + {b}·n²",
            "log": "{a} + {b}·log2 n", "power": "{a}·n^{b}"}
GROWTH_FORMS = ("linear", "nlogn", "quadratic", "power")


# ----------------------------------------------------------------------------------------------- fits


def fit_form(xs: Sequence[float], ys: Sequence[float], form: str) -> tuple[float, float]:
    """Least-squares (a, b) of ``form``: a + b·f(n) for the forms in FORMS, a·n^b (fitted in log space) for power."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if form == "power":
        b, log_a = np.polyfit(np.log(x), np.log(y), 1)
        return float(math.exp(log_a)), float(b)
    f = np.array([FORMS[form](v) for v in x])
    b, a = np.polyfit(f, y, 1)
    return float(a), float(b)


def evaluate(form: str, a: float, b: float, n: float) -> float:
    return a * n ** b if form == "power" else a + b * FORMS[form](n)


@dataclass(frozen=True)
class Fit:
    """A two-parameter fit of one measured quantity against n, with its residuals."""

    quantity: str
    form: str
    a: float
    b: float
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    holdout_error: float | None  # relative error at the largest x when fitted on the others alone

    def __call__(self, n: float) -> float:
        return evaluate(self.form, self.a, self.b, n)

    @property
    def residuals(self) -> tuple[float, ...]:
        """Model − measured at each input point."""
        return tuple(self(x) - y for x, y in zip(self.xs, self.ys, strict=True))

    @property
    def relative_residuals(self) -> tuple[float, ...]:
        return tuple(r / y for r, y in zip(self.residuals, self.ys, strict=True))

    @property
    def max_abs_residual(self) -> float:
        return max(abs(r) for r in self.residuals)

    @property
    def max_rel_residual(self) -> float:
        return max(abs(r) for r in self.relative_residuals)

    def formula(self) -> str:
        return FORMULAS[self.form].format(a=_g(self.a), b=_g(self.b))

    def summary(self) -> dict:
        return {"quantity": self.quantity, "form": self.form, "a": self.a, "b": self.b, "formula": self.formula(),
                "xs": list(self.xs), "ys": list(self.ys), "residuals": list(self.residuals),
                "relative_residuals": list(self.relative_residuals), "holdout_error": self.holdout_error}


def make_fit(quantity: str, xs: Sequence[float], ys: Sequence[float], form: str) -> Fit:
    a, b = fit_form(xs, ys, form)
    holdout = None
    if len(xs) >= 3:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        head, last = order[:-1], order[-1]
        ha, hb = fit_form([xs[i] for i in head], [ys[i] for i in head], form)
        holdout = evaluate(form, ha, hb, xs[last]) / ys[last] - 1
    return Fit(quantity, form, a, b, tuple(float(x) for x in xs), tuple(float(y) for y in ys), holdout)


def choose_fit(quantity: str, xs: Sequence[float], ys: Sequence[float],
               forms: Sequence[str] = GROWTH_FORMS) -> tuple[Fit, list[Fit]]:
    """The form that best predicts the largest x from the smaller ones (the question here is extrapolation);
    ties and too few points fall back to the smallest in-sample relative residual. Returns it and all candidates."""
    fits = [make_fit(quantity, xs, ys, form) for form in forms]
    best = min(fits, key=lambda f: (abs(f.holdout_error) if f.holdout_error is not None else 0.0, f.max_rel_residual))
    return best, fits


@dataclass(frozen=True)
class AllreduceFit:
    """Butterfly all-reduce time = ℓ·messages + bytes sent / ρ, messages = 2(n − 1) per learner."""

    message_seconds: float  # ℓ
    rate_bytes_per_second: float  # ρ
    points: tuple[tuple[int, float, float], ...]  # (learners, bytes sent per learner, seconds)

    def seconds(self, messages: float, bytes_sent: float) -> float:
        return self.message_seconds * messages + bytes_sent / self.rate_bytes_per_second

    def butterfly_seconds(self, n: float, gradient_bytes: float) -> float:
        return self.seconds(2 * (n - 1), butterfly_factor(n) * gradient_bytes)

    @property
    def residuals(self) -> tuple[float, ...]:
        return tuple(self.seconds(2 * (n - 1), b) - t for n, b, t in self.points)

    @property
    def relative_residuals(self) -> tuple[float, ...]:
        return tuple(r / t for r, (_, _, t) in zip(self.residuals, self.points, strict=True))


def fit_allreduce(points: Sequence[tuple[int, float, float]]) -> AllreduceFit:
    """Least squares without intercept: t = ℓ·2(n − 1) + B/ρ."""
    x = np.array([[2.0 * (n - 1), b] for n, b, _ in points])
    t = np.array([s for _, _, s in points])
    (ell, inv_rate), *_ = np.linalg.lstsq(x, t, rcond=None)
    return AllreduceFit(float(ell), float(1.0 / inv_rate), tuple((int(n), float(b), float(s)) for n, b, s in points))


# ----------------------------------------------------------------------------------------------- pure formulas


def butterfly_factor(n: float) -> float:
    """Bytes a learner sends in a butterfly all-reduce of n, as a multiple of its outer gradient: 2(n − 1)/n."""
    return 2 * (n - 1) / n


def two_level_factor(g: float, groups: int) -> float:
    """The same for the two-level scheme: 2(g − 1)/g inside the group + 2(G − 1)/(G·g) for its shard across groups."""
    return 2 * (g - 1) / g + 2 * (groups - 1) / (groups * g)


def grouping(learners: int, group_size: int) -> tuple[int, float]:
    """G = ceil(M / g) groups and their mean size M / G."""
    groups = max(1, math.ceil(learners / group_size))
    return groups, learners / groups


def expected_max_normal(mean: float, sd: float, count: int) -> float:
    """E[max of ``count`` normal draws] (Blom's approximation); ``mean`` for one."""
    if count <= 1 or sd <= 0:
        return mean
    return mean + sd * statistics.NormalDist().inv_cdf((count - 0.375) / (count + 0.25))


def failure_probability(failures_per_hour: float, exposures: Sequence[tuple[int, float]]) -> float:
    """P(at least one failure) when each (n, seconds) exposure is n learners that must not fail for that long,
    every learner failing as a Poisson process: 1 − exp(−λ·Σ n·t)."""
    rate = failures_per_hour / 3600.0
    return -math.expm1(-rate * sum(n * t for n, t in exposures))


def monte_carlo_failure(failures_per_hour: float, exposures: Sequence[tuple[int, float]], trials: int,
                        seed: int) -> tuple[float, float]:
    """The same probability sampled: each learner's next failure after the round starts is drawn (exponential,
    memoryless), and a trial fails when one falls inside its exposure. Returns (estimate, standard error)."""
    rng = np.random.default_rng(seed)
    scale = 3600.0 / failures_per_hour
    failed = np.zeros(trials, dtype=bool)
    for n, seconds in exposures:
        if n <= 0 or seconds <= 0:
            continue
        rows = max(1, 2_000_000 // n)  # bound the memory of one draw
        for start in range(0, trials, rows):
            stop = min(trials, start + rows)
            first = rng.exponential(scale, size=(stop - start, n)).min(axis=1)
            failed[start:stop] |= first < seconds
    p = float(failed.mean())
    return p, math.sqrt(max(p * (1 - p), 1e-12) / trials)


# ----------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Model:
    matchmaking: Fit
    matchmaking_p90: Fit
    certificate: Fit
    dht_calls: Fit
    dht_kb_per_call: Fit  # c0 + κ·(records per read)
    rss_mb: float
    rss_mb_per_peer: float  # fitted slope, reported only
    allreduce: AllreduceFit
    gradient_bytes: float
    signature_bytes: float = SIGNATURE_BYTES
    index_entry_bytes: float = INDEX_ENTRY_BYTES

    def formation(self, n: float, groups: int = 1) -> float:
        """Seconds until the slowest of ``groups`` groups of n has formed."""
        mean = max(0.0, self.matchmaking(n))
        sd = max(0.0, self.matchmaking_p90(n) - mean) / statistics.NormalDist().inv_cdf(0.9)
        return expected_max_normal(mean, sd, groups)

    def dht_kb(self, learners: int, records_per_read: float, index_bytes: float = 0.0) -> float:
        calls = max(0.0, self.dht_calls(learners))
        return calls * (self.dht_kb_per_call.a + self.dht_kb_per_call.b * records_per_read) + index_bytes / 1024

    def baseline(self, learners: int, failures_per_hour: float) -> dict:
        n = learners
        allreduce = self.allreduce.butterfly_seconds(n, self.gradient_bytes) if n > 1 else 0.0
        round_s = self.formation(n) + max(0.0, self.certificate(n)) + allreduce
        exposures = [(n, round_s)]
        return {
            "design": "baseline", "learners": n, "groups": 1, "group_size": float(n), "peers": n - 1,
            "round_seconds": round_s, "allreduce_seconds": allreduce, "cross_group_seconds": 0.0,
            "gradient_factor": butterfly_factor(n), "mb_sent": butterfly_factor(n) * self.gradient_bytes / 1e6,
            "dht_kb": self.dht_kb(n, n), "certificate_kb": n * self.signature_bytes / 1024,
            "rss_mb": self.rss_mb, "exposures": exposures,
            "p_fail": failure_probability(failures_per_hour, exposures),
            "p_fail_group_dropped": None,
        }

    def two_level(self, learners: int, group_size: int, failures_per_hour: float) -> dict:
        groups, g = grouping(learners, group_size)
        s = self.gradient_bytes
        ar = self.allreduce
        inside = ar.seconds(g - 1, (g - 1) / g * s) if g > 1 else 0.0  # reduce-scatter; the all-gather is the same
        cross = ar.seconds(2 * (groups - 1), butterfly_factor(groups) * s / g) if groups > 1 else 0.0
        # Group certificates to the G − 1 counterparts (g signatures each): the majority certificate assembled.
        cert_cross = ar.seconds(groups - 1, (groups - 1) * g * self.signature_bytes) if groups > 1 else 0.0
        allreduce = 2 * inside + cross
        round_s = self.formation(g, groups) + max(0.0, self.certificate(g)) + cert_cross + allreduce
        own = math.ceil(learners / groups)
        written = [(own, round_s), (learners - own, cross)]
        dropped = [(own, round_s)]
        quorum = learners // 2 + 1  # a majority certificate's signatures
        return {
            "design": "two-level", "learners": learners, "groups": groups, "group_size": g,
            "peers": own - 1 + groups - 1, "round_seconds": round_s, "allreduce_seconds": allreduce,
            "cross_group_seconds": cross, "gradient_factor": two_level_factor(g, groups),
            "mb_sent": two_level_factor(g, groups) * s / 1e6,
            "dht_kb": self.dht_kb(learners, 1, 2 * learners * self.index_entry_bytes),
            "certificate_kb": (quorum if groups > 1 else learners) * self.signature_bytes / 1024,
            "rss_mb": self.rss_mb, "exposures": written,
            "p_fail": failure_probability(failures_per_hour, written),
            "p_fail_group_dropped": failure_probability(failures_per_hour, dropped),
        }


def measured_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with every figure the model needs, sorted by M, with the certificate time derived
    (round = matchmaking + all-reduce + certificate in scale_swarm.py)."""
    out = []
    for r in rows:
        if all(r.get(k) is not None for k in MEASURED_KEYS):
            r = dict(r)
            r["certify_seconds_mean"] = max(1e-3, r["round_seconds_mean"] - r["matchmaking_seconds_mean"]
                                            - r["allreduce_seconds_mean"])
            out.append(r)
    return sorted(out, key=lambda r: r["learners"])


def build_model(measured: Sequence[dict], allreduce_points: Sequence[tuple[int, float, float]],
                gradient_bytes: float = GRADIENT_BYTES, message_seconds: float | None = None,
                rate_mb_s: float | None = None, signature_bytes: float = SIGNATURE_BYTES,
                index_entry_bytes: float = INDEX_ENTRY_BYTES) -> tuple[Model, dict[str, list[Fit]]]:
    rows = measured_rows(measured)
    if len(rows) < 2:
        raise ValueError("the model needs measurements at two swarm sizes at least")
    m = [float(r["learners"]) for r in rows]
    candidates: dict[str, list[Fit]] = {}
    mm, candidates["matchmaking s (mean)"] = choose_fit("matchmaking s (mean)", m,
                                                        [r["matchmaking_seconds_mean"] for r in rows])
    p90, candidates["matchmaking s (p90)"] = choose_fit("matchmaking s (p90)", m,
                                                        [r["matchmaking_seconds_p90"] for r in rows])
    cert, candidates["certificate s (mean)"] = choose_fit("certificate s (mean)", m,
                                                          [r["certify_seconds_mean"] for r in rows])
    calls = make_fit("DHT calls / learner / round", m, [r["dht_calls_per_learner_per_version"] for r in rows], "log")
    kb_per_call = [r["dht_kb_per_learner_per_version"] / r["dht_calls_per_learner_per_version"] for r in rows]
    per_call = make_fit("DHT KB / call", m, kb_per_call, "linear")
    rss = [r["rss_mb_per_learner_mean"] for r in rows]
    slope = float(np.polyfit([x - 1 for x in m], rss, 1)[0])
    ar = fit_allreduce(allreduce_points)
    if message_seconds is not None or rate_mb_s is not None:
        ar = AllreduceFit(ar.message_seconds if message_seconds is None else message_seconds,
                          ar.rate_bytes_per_second if rate_mb_s is None else rate_mb_s * 1e6, ar.points)
    model = Model(mm, p90, cert, calls, per_call, statistics.fmean(rss), slope, ar, gradient_bytes,
                  signature_bytes, index_entry_bytes)
    return model, candidates


def check_rows(model: Model, measured: Sequence[dict]) -> list[dict]:
    """The model at each measured M (one group of M: the two designs coincide while M ≤ g) beside the measurement."""
    out = []
    for r in measured_rows(measured):
        m = r["learners"]
        pred = model.baseline(m, 0.0)
        achieved = statistics.fmean(r["group_sizes"]) if r.get("group_sizes") else float(m)
        pairs = [
            ("matchmaking s", model.matchmaking(m), r["matchmaking_seconds_mean"], "fit"),
            ("certificate s", model.certificate(m), r["certify_seconds_mean"], "fit"),
            ("all-reduce s, group of M", pred["allreduce_seconds"], r["allreduce_seconds_mean"],
             "allreduce_bench fit, not fitted to this run"),
            (f"all-reduce s, groups formed (mean {achieved:.1f})",
             model.allreduce.butterfly_seconds(achieved, model.gradient_bytes), r["allreduce_seconds_mean"],
             "allreduce_bench fit, not fitted to this run"),
            ("round s", pred["round_seconds"], r["round_seconds_mean"], "sum of the above (group of M)"),
            ("DHT calls / learner / round", model.dht_calls(m), r["dht_calls_per_learner_per_version"], "fit"),
            ("DHT KB / learner / round", pred["dht_kb"], r["dht_kb_per_learner_per_version"], "product of two fits"),
            ("RSS MB / learner", model.rss_mb, r["rss_mb_per_learner_mean"], "constant (mean)"),
        ]
        for name, model_value, measured_value, basis in pairs:
            out.append({"learners": m, "quantity": name, "model": model_value, "measured": measured_value,
                        "relative_error": model_value / measured_value - 1, "basis": basis})
    return out


# ----------------------------------------------------------------------------------------------- inputs


def load_measured(paths: Sequence[str]) -> tuple[list[dict], dict]:
    """scale_swarm.py results from ``paths`` (later files win for the same M), or the built-in table."""
    by_m: dict[int, dict] = {}
    used = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows = data if isinstance(data, list) else data.get("results", [])
        for r in measured_rows(rows):
            by_m[int(r["learners"])] = r
        used.append(str(path))
    if by_m:
        return [by_m[k] for k in sorted(by_m)], {"files": used}
    return [dict(r) for r in MEASURED_DEFAULT], {**MEASURED_SOURCE, "files": "built-in table (MEASURED_DEFAULT)"}


def load_allreduce(path: str | None) -> tuple[list[tuple[int, float, float]], dict]:
    if path and Path(path).exists():
        data = json.loads(Path(path).read_text())
        points = [(int(r["learners"]), float(r["hm_bytes_sent_mean_per_learner"]), float(r["hm_allreduce_s_median"]))
                  for r in data.get("rows", [])
                  if r.get("hm_allreduce_s_median") and r.get("hm_bytes_sent_mean_per_learner")]
        if len(points) >= 2:
            meta = data.get("meta", {})
            return points, {"file": path, "command": meta.get("command"), "commit": meta.get("p2p_diloco_revision"),
                            "date": meta.get("date")}
    return list(ALLREDUCE_DEFAULT), {**ALLREDUCE_SOURCE, "file": "built-in table (ALLREDUCE_DEFAULT)"}


# ----------------------------------------------------------------------------------------------- output


def _g(x: float) -> str:
    """A number with 3 significant digits, thousands separated."""
    if x == 0 or not math.isfinite(x):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:+.0%}" if abs(x) >= 0.005 else f"{x:+.1%}"


def _prob(p: float | None) -> str:
    if p is None:
        return "-"
    if p >= 0.9995:
        return "≈ 1"
    return f"{p:.2%}" if p >= 0.0001 else f"{p:.1e}"


def _seconds(s: float) -> str:
    if s >= 86400:
        return f"{_g(s)} ({s / 86400:,.0f} d)"
    if s >= 3600:
        return f"{_g(s)} ({s / 3600:.1f} h)"
    return _g(s)


def fits_table(model: Model, candidates: dict[str, list[Fit]]) -> str:
    lines = ["| quantity | form used | fit | residuals at M = " + ", ".join(str(int(x)) for x in model.matchmaking.xs)
             + " (model − measured) | largest from the smaller (held out) | other forms, held out |",
             "|---|---|---|---|---|---|"]
    for name, fits in candidates.items():
        used = next(f for f in fits if f.form == {"matchmaking s (mean)": model.matchmaking.form,
                                                     "matchmaking s (p90)": model.matchmaking_p90.form,
                                                     "certificate s (mean)": model.certificate.form}[name])
        others = ", ".join(f"{f.form} {_pct(f.holdout_error)}" for f in fits if f is not used)
        lines.append(f"| {name} | {used.form} | {used.formula()} | "
                     + ", ".join(f"{_g(r)} ({_pct(q)})" for r, q in zip(used.residuals, used.relative_residuals,
                                                                     strict=True))
                     + f" | {_pct(used.holdout_error)} | {others} |")
    for fit in (model.dht_calls, model.dht_kb_per_call):
        lines.append(f"| {fit.quantity} | {fit.form} (fixed) | {fit.formula()} | "
                     + ", ".join(f"{_g(r)} ({_pct(q)})" for r, q in zip(fit.residuals, fit.relative_residuals,
                                                                     strict=True))
                     + f" | {_pct(fit.holdout_error)} | - |")
    ar = model.allreduce
    rel = ar.relative_residuals
    lines.append(f"| all-reduce s (allreduce_bench, {len(ar.points)} runs) | ℓ·2(n − 1) + bytes/ρ | "
                 f"ℓ = {ar.message_seconds * 1000:.1f} ms, ρ = {ar.rate_bytes_per_second / 1e6:.1f} MB/s | "
                 f"RMS {_g(math.sqrt(statistics.fmean(r * r for r in ar.residuals)))} s, relative "
                 f"{min(rel):+.0%} to {max(rel):+.0%} | - | - |")
    lines.append(f"| RSS MB / learner | constant | {model.rss_mb:.0f} | slope {model.rss_mb_per_peer:.2f} MB per peer "
                 "if fitted (not used) | - | - |")
    return "\n".join(lines)


def check_table(rows: Sequence[dict]) -> str:
    lines = ["| M | quantity | measured | model | error | basis |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['learners']} | {r['quantity']} | {_g(r['measured'])} | {_g(r['model'])} | "
                     f"{_pct(r['relative_error'])} | {r['basis']} |")
    return "\n".join(lines)


def predictions_table(rows: Sequence[dict]) -> str:
    lines = ["| design | M | groups × size | peers / learner | round s | all-reduce s (cross-group) | "
             "MB sent / learner (× gradient) | DHT KB / learner / round | certificate KB | RSS MB / learner | "
             "P(round fails) | P(round fails), cross step drops a failed group |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['design']} | {r['learners']:,} | {r['groups']} × {_g(r['group_size'])} | {r['peers']:,} | "
            f"{_seconds(r['round_seconds'])} | {_g(r['allreduce_seconds'])} ({_g(r['cross_group_seconds'])}) | "
            f"{_g(r['mb_sent'])} ({r['gradient_factor']:.2f}) | {_g(r['dht_kb'])} | {_g(r['certificate_kb'])} | "
            f"{r['rss_mb']:.0f} | {_prob(r['p_fail'])} | {_prob(r['p_fail_group_dropped'])} |")
    return "\n".join(lines)


def mc_table(rows: Sequence[dict]) -> str:
    lines = ["| design | M | learners × seconds exposed | analytic | Monte-Carlo (± s.e.) | "
             "z (s.e. of the analytic p) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['design']} | {r['learners']:,} | {_g(r['exposure'])} | {_prob(r['analytic'])} | "
                     f"{_prob(r['monte_carlo'])} ± {r['standard_error']:.4f} | {r['z']:+.1f} |")
    return "\n".join(lines)


def sweep_table(rows: Sequence[dict]) -> str:
    lines = ["| g | groups | peers / learner | round s | formation s | cross-group s | MB sent / learner | "
             "P(round fails) | P, cross step drops a failed group |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['requested_group_size']} | {r['groups']} | {r['peers']:,} | "
                     f"{_seconds(r['round_seconds'])} | {_g(r['formation_seconds'])} | "
                     f"{_g(r['cross_group_seconds'])} | {_g(r['mb_sent'])} | "
                     f"{_prob(r['p_fail'])} | {_prob(r['p_fail_group_dropped'])} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    measured_paths = args.measured if args.measured is not None else sorted(
        glob.glob(str(ROOT / "benchmarks" / "results" / "scale_[0-9]*.json")))
    measured, measured_source = load_measured(measured_paths)
    points, allreduce_source = load_allreduce(args.allreduce_json)
    model, candidates = build_model(measured, points, args.gradient_mb * 1e6, args.message_seconds, args.rate_mb_s,
                                    args.signature_bytes, args.index_entry_bytes)
    lam = args.failures_per_hour
    predictions = []
    for m in args.learners:
        predictions += [model.baseline(m, lam), model.two_level(m, args.group_size, lam)]
    mc = []
    for i, p in enumerate(predictions):
        est, se = monte_carlo_failure(lam, p["exposures"], args.mc_trials, args.seed + i)
        expected_se = math.sqrt(p["p_fail"] * (1 - p["p_fail"]) / args.mc_trials)  # under the analytic value
        mc.append({"design": p["design"], "learners": p["learners"], "exposure": sum(n * t for n, t in p["exposures"]),
                   "analytic": p["p_fail"], "monte_carlo": est, "standard_error": se,
                   "z": (est - p["p_fail"]) / expected_se if expected_se > 1e-9 else 0.0})
    largest = max(args.learners)
    sweep = []
    for g in args.sweep_group_sizes:
        r = model.two_level(largest, g, lam)
        formation = model.formation(r["group_size"], r["groups"])
        sweep.append({**r, "requested_group_size": g, "formation_seconds": formation})
    return {"args": vars(args), "measured_source": measured_source, "measured": measured,
            "allreduce_source": allreduce_source, "model": {
                "matchmaking": model.matchmaking.summary(), "matchmaking_p90": model.matchmaking_p90.summary(),
                "certificate": model.certificate.summary(), "dht_calls": model.dht_calls.summary(),
                "dht_kb_per_call": model.dht_kb_per_call.summary(), "rss_mb": model.rss_mb,
                "rss_mb_per_peer_slope": model.rss_mb_per_peer,
                "allreduce": {"message_seconds": model.allreduce.message_seconds,
                              "rate_bytes_per_second": model.allreduce.rate_bytes_per_second,
                              "points": model.allreduce.points, "residuals": model.allreduce.residuals},
                "gradient_bytes": model.gradient_bytes, "signature_bytes": model.signature_bytes,
                "index_entry_bytes": model.index_entry_bytes,
                "candidates": {k: [f.summary() for f in v] for k, v in candidates.items()}},
            "check": check_rows(model, measured), "predictions": predictions, "monte_carlo": mc,
            "group_size_sweep": sweep,
            "_model": model, "_candidates": candidates}


def render(result: dict) -> str:
    args = result["args"]
    src = result["measured_source"]
    out = [f"Measured inputs: {src.get('files')}" + (f" ({src['command']}; commit {src['commit']}, {src['date']})"
                                                   if "command" in src else ""),
           f"All-reduce inputs: {result['allreduce_source'].get('file')}",
           "", "### Fits", "", fits_table(result["_model"], result["_candidates"]),
           "", "### Check: the model at the measured swarm sizes", "", check_table(result["check"]),
           "", f"### Predictions (g = {args['group_size']}, {args['failures_per_hour']} failures per learner-hour, "
               f"outer gradient {args['gradient_mb']:.3g} MB)", "", predictions_table(result["predictions"]),
           "", f"### Failure exposure, analytic vs Monte-Carlo ({args['mc_trials']} trials, seed {args['seed']})", "",
           mc_table(result["monte_carlo"]),
           "", f"### Group size at M = {max(args['learners']):,}", "", sweep_table(result["group_size_sweep"])]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--learners", type=int, nargs="+", default=[4, 8, 16, 100, 1000, 10000])
    ap.add_argument("--group-size", type=int, default=16, help="g of the two-level design")
    ap.add_argument("--failures-per-hour", type=float, default=0.1, help="per learner: deaths and stalls")
    ap.add_argument("--gradient-mb", type=float, default=GRADIENT_BYTES / 1e6,
                    help="outer gradient per learner per round (default: the small model, fp32)")
    ap.add_argument("--measured", nargs="*", default=None,
                    help="scale_swarm.py JSON files (default: benchmarks/results/scale_<date>*.json, "
                         "else the built-in table)")
    ap.add_argument("--allreduce-json", default=str(ROOT / "benchmarks" / "results" / "allreduce_bench.json"))
    ap.add_argument("--message-seconds", type=float, help="override the fitted per-part overhead ℓ (e.g. a WAN's)")
    ap.add_argument("--rate-mb-s", type=float, help="override the fitted per-learner rate ρ")
    ap.add_argument("--signature-bytes", type=float, default=SIGNATURE_BYTES)
    ap.add_argument("--index-entry-bytes", type=float, default=INDEX_ENTRY_BYTES)
    ap.add_argument("--sweep-group-sizes", type=int, nargs="*", default=[8, 16, 32, 64, 100, 128])
    ap.add_argument("--mc-trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write inputs, fits, check, predictions and the Monte-Carlo here")
    args = ap.parse_args(argv)
    if min(args.learners) < 2 or args.group_size < 2 or args.failures_per_hour <= 0 or args.mc_trials < 1:
        ap.error("--learners and --group-size must be at least 2, --failures-per-hour and --mc-trials positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(render(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        public = {k: v for k, v in result.items() if not k.startswith("_")}
        Path(args.json).write_text(json.dumps(public, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
