"""Measured training iterations against predictions: calibration, the report, the baseline.

Cases come from data/validation/ (written by `make validate` on a GPU). The host model (the only
fitted constants: per-operator host costs and the L2 warm/cold blend) is fitted on the calibration
split alone; the holdout split never touches a fitted constant and is reported separately. A
precision-unaware baseline (one static precision profile for every setting) reproduces the gap
the reference paper describes.
"""

from __future__ import annotations

import glob
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.schema.model_config import ConfigError, family_label, parse_config
from tp_query.schema.precision import Setting
from tp_query.schema.tables import METADATA_KEY

from .framework import FIRST_MACHINE, utc_time
from .hostsim import CALIBRATION_MAX_US, HostModel
from .parallel import ParallelConfig, PlanError
from .predict import Engine, PredictError, PredictRequest


@dataclass
class CaseResult:
    case_id: str
    model: str
    setting: str
    split: str
    micro_batch: int
    seq_len: int
    tp_shard: int
    status: str
    measured_ms: float | None
    predicted_ms: float | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    measured_peak_gib: float | None = None
    predicted_peak_gib: float | None = None
    predicted_fits: bool | None = None
    sources: dict[str, float] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    kernel_ms: float | None = None
    kernel_breakdown: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    framework: str = ""  # distributed runs: torch | megatron
    kind: str = ""  # distributed runs: ddp, fsdp_z3, tp, pp_1f1b, mcore_dp, ...
    shape_split: str = ""  # distributed runs: calibration (shapes shared with calibration) | holdout
    host_ms: float | None = None  # the slowest rank's host issue time of a step (where the run recorded it)
    family: str = ""  # the spec registry's family of the config that ran
    machine: str = ""  # the machine instance it ran on ("": before instances were told apart)
    # its host costs are its own instance's (measured there, or the first period's probe), not the median of others'
    own_host: bool = True
    user_ms: float | None = None  # runs of a known instance: predicted as a user is (the typical host), that instance left out

    @property
    def user_ape(self) -> float | None:
        if self.user_ms is None or not self.measured_ms:
            return None
        return abs(self.user_ms - self.measured_ms) / self.measured_ms

    @property
    def ape(self) -> float | None:
        if self.measured_ms and self.predicted_ms:
            return abs(self.predicted_ms - self.measured_ms) / self.measured_ms
        return None

    @property
    def signed(self) -> float | None:
        if self.measured_ms and self.predicted_ms:
            return (self.predicted_ms - self.measured_ms) / self.measured_ms
        return None

    @property
    def mem_error(self) -> float | None:
        if self.measured_peak_gib and self.predicted_peak_gib and self.status == "ok":
            return (self.predicted_peak_gib - self.measured_peak_gib) / self.measured_peak_gib
        return None

    @property
    def verdict_right(self) -> bool | None:
        if self.predicted_fits is None or self.status not in ("ok", "oom"):
            return None
        return self.predicted_fits == (self.status == "ok")


def _read_run_file(f: str, gpu: str | None) -> pa.Table:
    """One file of measured runs, refused when it was measured on another GPU (its provenance or its rows)."""
    t = pq.read_table(f)
    if gpu is None:
        return t
    meta = (t.schema.metadata or {}).get(METADATA_KEY)
    try:
        prov_gpu = json.loads(meta).get("gpu") if meta else None
    except (ValueError, AttributeError):
        raise ValueError(f"{f}: unreadable provenance") from None
    rows_gpu = set(t.column("gpu").to_pylist()) if "gpu" in t.column_names else set()
    foreign = ({prov_gpu} | rows_gpu) - {gpu, None}
    if foreign:
        raise ValueError(f"{f}: runs measured on {', '.join(sorted(map(repr, foreign)))}, not {gpu!r} (a "
                         "report compares one GPU's runs with its own database)")
    return t


def _latest_rows(files: list[str], gpu: str | None = None) -> list[dict[str, Any]]:
    if not files:
        return []
    rows = pa.concat_tables([_read_run_file(f, gpu) for f in files], promote_options="default").to_pylist()
    latest: dict[str, dict[str, Any]] = {}
    for r in rows:
        latest[r["case_id"]] = r
    return list(latest.values())


def load_rows(root: Path, gpu: str | None = None) -> list[dict[str, Any]]:
    """The latest row of every case, then the cases measured again as samples of other machine instances
    (<root>/machines/<id>/, `dist-validate --machine-sample`) as cases of their own, `<case>@<id>`, each
    predicted with its instance's measured host costs. Rows of the main folder carry the instance they ran on
    where the collector recorded it (None before it did)."""
    out = _latest_rows(sorted(glob.glob(str(root / "validation-*.parquet"))), gpu)  # validation-dist-* included
    for r in out:
        r["machine"] = r.get("machine") or None
    for d in sorted(p for p in (root / "machines").glob("*") if p.is_dir()):
        for r in _latest_rows(sorted(glob.glob(str(d / "validation-*.parquet"))), gpu):
            out.append({**r, "case_id": f"{r['case_id']}@{d.name}", "machine": d.name})
    return out


# What each distributed kind means as a request (see collector/dist_validate.py for how it ran).
DIST_KINDS: dict[str, dict[str, Any]] = {
    "ddp": {}, "ddp_bucket_view": {"ddp_bucket_view": True}, "fsdp_z3": {"zero": 3}, "fsdp_z2": {"zero": 2},
    "tp": {}, "tp_sp": {"sequence_parallel": True}, "pp_1f1b": {}, "pp_gpipe": {"pp_schedule": "gpipe"},
    "pp_interleaved": {"pp_schedule": "interleaved"},
    "mcore_dp": {"framework": "megatron"}, "mcore_dp_distopt": {"framework": "megatron", "zero": 1},
    "mcore_tp": {"framework": "megatron"}, "mcore_pp": {"framework": "megatron"},
    "mcore_moe": {"framework": "megatron"}, "mcore_moe_distopt": {"framework": "megatron", "zero": 1},
    "mcore_1gpu": {"framework": "megatron"},
}


def _breakdown(js: str | None) -> dict[str, Any]:
    """One GPU: a dict; distributed runs: one profile per rank."""
    obj = json.loads(js) if js else {}
    return {"ranks": obj} if isinstance(obj, list) else obj


class Study:
    """All validation cases, assembled once, evaluated under any host model."""

    BASELINES: ClassVar[dict[str, Setting]] = {"static-tf32": Setting.TF32, "static-bf16": Setting.BF16}

    def __init__(self, engine: Engine, rows: list[dict[str, Any]], with_baselines: bool = True) -> None:
        self.engine = engine
        self.cases: list[CaseResult] = []
        self.assembled: dict[str, Any] = {}
        self.baseline_asm: dict[tuple[str, str], Any] = {}
        self.stage_of: dict[str, int] = {}
        calibration_models = {r["model"] for r in rows if r["split"] == "calibration" and not r.get("dist_kind")}
        for r in sorted(rows, key=lambda r: r["case_id"]):
            shard_cfg = json.loads(r["config_json"])
            c = CaseResult(r["case_id"], r["model"], r["setting"], r["split"], r["micro_batch"], r["seq_len"],
                           int(r["tp_shard"] or 1), r["status"], r["iteration_ms"],
                           measured_peak_gib=(r["peak_allocated_bytes"] or 0) / 2**30 or None,
                           kernel_ms=r.get("kernel_ms"),
                           kernel_breakdown=_breakdown(r.get("kernel_breakdown_json")))
            c.machine = r.get("machine") or ""
            try:
                c.family = family_label(parse_config(shard_cfg).to_dict())
            except ConfigError:
                c.family = ""
            accum = int(r.get("accum") or 1)
            dp, tp, pp = int(r.get("dp") or 1), int(r.get("tp") or 1), int(r.get("pp") or 1)
            extra: dict[str, Any] = {}
            ep = int(json.loads(r.get("options_json") or "{}").get("ep", 1))
            if r.get("dist_kind"):  # a distributed run: its own section, never in the one-GPU fit
                # its shapes are "shared" when the same model is a one-GPU calibration case (exact calls measured)
                shared = r["model"] in calibration_models
                c.framework, c.kind, c.split = r["framework"], r["dist_kind"], "distributed"
                c.shape_split = "calibration" if shared else "holdout"
                extra = {**DIST_KINDS.get(r["dist_kind"], {}), **({"ep": ep} if ep > 1 else {})}
            # the host's issue time per step, per rank (distributed runs; one-GPU runs since session 35)
            ranks = json.loads(r["rank_json"]) if r.get("rank_json") else []
            hosts = [x["host_ms"] for x in ranks if x.get("host_ms")]
            c.host_ms = max(hosts) if hosts else None
            stage = r.get("pp_stage")
            if stage:  # one stage of a PP split, alone on one GPU: compare with that stage's prediction
                self.stage_of[c.case_id] = {"first": 0, "middle": 1, "last": pp - 1}[stage]
                # one micro-batch through one stage, no schedule ran: GPipe's order takes any micro-batch count
                # (Schedule1F1B refuses fewer than PP), and one micro-batch's stage work and memory are the same
                extra = {**extra, "pp_schedule": "gpipe"}
            # What ran: the shard-shaped model on one GPU (for TP shards, a plain HF model of the shard), or
            # a distributed run with its split.
            try:
                par = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=r["micro_batch"],
                                     global_batch=r["micro_batch"] * accum * dp, **extra)
                req = PredictRequest(model=shard_cfg, model_name=r["model"], gpu=engine.gpu.name,
                                     setting=Setting(r["setting"]), parallel=par, seq_len=r["seq_len"],
                                     optimizer=r["optimizer"])
                own = self._host_machine(r)
                # a run fits host constants only where its instance's per-operator host costs were measured: a
                # database without host probes has none (its GPU-bound runs had driven every constant to zero)
                c.own_host = own is not None
                self.assembled[c.case_id] = engine.assemble(req, host_machine=own)
                if with_baselines and c.status == "ok" and c.split != "distributed":
                    for name, s in self.BASELINES.items():
                        self.baseline_asm[(c.case_id, name)] = engine.assemble(replace(req, setting=s))
            except (PredictError, PlanError) as e:
                c.error = str(e)
            self.cases.append(c)

    def _host_machine(self, row: dict[str, Any]) -> str | None:
        """The instance whose host costs predict this run: its own where measured; a run that names none and was
        measured before instances were told apart, that period's (FIRST_MACHINE); one that names none measured
        since (an instance nobody recorded), and any other, the typical host (the median over instances)."""
        fw = self.engine.framework
        have = fw.machines()
        want = row.get("machine")
        if not want:
            since, at = fw.instances_named_since(), row.get("measured_at")
            want = None if since is not None and at is not None and utc_time(at) >= since else FIRST_MACHINE
        return want if want in have else None

    def _time(self, asm: Any, c: CaseResult, host: HostModel) -> float:
        total_us, _, per_stage, _ = asm.evaluate(host)
        if c.case_id in self.stage_of:
            st = per_stage[self.stage_of[c.case_id]]
            return (st["fwd_us"] + st["bwd_us"] + st["opt_us"] + host.per_iteration_us) / 1e3
        return total_us / 1e3

    def runs(self, split: str | None) -> list[CaseResult]:
        """A split's measured, predicted runs. The calibration split fits host constants beyond the measured
        per-operator host costs, so it holds only runs whose per-operator costs are their own instance's: a run of
        an instance without a probe is predicted with the other instances' median, and fitting on it would fold
        that instance's host speed into the constants (it is still reported, as a user's prediction)."""
        return [c for c in self.cases if c.status == "ok" and c.case_id in self.assembled
                and (not split or c.split == split) and (split != "calibration" or c.own_host)]

    def errors(self, host: HostModel, split: str | None) -> list[float]:
        out = []
        for c in self.runs(split):
            pred = self._time(self.assembled[c.case_id], c, host)
            assert c.measured_ms
            out.append(math.log(pred / c.measured_ms))
        return out

    # Each fitted constant is a host cost in microseconds within physical bounds (or the warm/cold blend in
    # [0, 1]). Per-operator host costs (forward, backward, optimizer) are measured (data/<gpu>/framework/).
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "per_tensor_us": (0.0, CALIBRATION_MAX_US["per_tensor_us"]),
        "per_iteration_us": (0.0, CALIBRATION_MAX_US["per_iteration_us"]), "beta": (0.0, 1.0)}

    def fit(self, iters: int = 400) -> HostModel:
        """Nelder-Mead on the calibration split (mean squared log error), deterministic: it starts from
        HostModel's fixed defaults, never from a previous fit, and maps each constant into its bounds."""
        names = list(self.BOUNDS)
        start = HostModel()

        def unpack(x: np.ndarray) -> HostModel:
            vals = {}
            for n, v in zip(names, x, strict=True):
                lo, hi = self.BOUNDS[n]
                vals[n] = lo + (hi - lo) / (1 + math.exp(-float(v)))
            return replace(start, **vals)

        def pack(h: HostModel) -> np.ndarray:
            out = []
            for n in names:
                lo, hi = self.BOUNDS[n]
                f = min(max((getattr(h, n) - lo) / (hi - lo), 1e-4), 1 - 1e-4)
                out.append(math.log(f / (1 - f)))
            return np.array(out)

        def loss(x: np.ndarray) -> float:
            e = self.errors(unpack(x), "calibration")
            return float(np.mean(np.square(e))) if e else 0.0

        return unpack(_nelder_mead(loss, pack(start), iters))

    def finalize(self, host: HostModel) -> None:
        for c in self.cases:
            asm = self.assembled.get(c.case_id)
            if asm is None:
                continue
            p = asm.run(host)
            c.predicted_ms = self._time(asm, c, host)
            c.breakdown = p.breakdown
            c.predicted_peak_gib = p.peak_memory_gib
            c.predicted_fits = p.fits
            if c.case_id in self.stage_of:
                c.predicted_peak_gib = p.stages[self.stage_of[c.case_id]]["peak_memory_gib"]
            c.sources = p.sources
            if c.machine:  # as a user's prediction: the typical host, its own instance's measurements left out
                own = asm.fw
                try:
                    asm._use_host_instance(self.engine.framework.without(c.machine))
                    c.user_ms = self._time(asm, c, host)
                finally:
                    asm._use_host_instance(own)
            for name in self.BASELINES:
                a = self.baseline_asm.get((c.case_id, name))
                if a is not None:
                    c.baselines[name] = self._time(a, c, host)


def _nelder_mead(f: Any, x0: np.ndarray, iters: int) -> np.ndarray:
    n = len(x0)
    pts = [x0] + [x0 + np.eye(n)[i] * 0.5 for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < 1e-10:
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _mape(cs: list[CaseResult], key: str | None = None) -> tuple[float, float, int]:
    errs = []
    for c in cs:
        if c.status != "ok" or not c.measured_ms:
            continue
        pred = c.predicted_ms if key is None else c.baselines.get(key)
        if pred:
            errs.append(abs(pred - c.measured_ms) / c.measured_ms)
    if not errs:
        return float("nan"), float("nan"), 0
    return statistics.mean(errs), max(errs), len(errs)


SPLITS = ("calibration", "holdout", "all", "distributed")


def summary(cases: list[CaseResult]) -> dict[str, Any]:
    """Per split; "all" is every one-GPU case (calibration + holdout); distributed runs apart."""
    out: dict[str, Any] = {}
    for name in SPLITS:
        sel = [c for c in cases if (c.split == name if name != "all" else c.split in ("calibration", "holdout"))]
        per = {}
        for s in Setting:
            m, mx, n = _mape([c for c in sel if c.setting == s.value])
            per[s.value] = {"mape": m, "max": mx, "n": n}
        m, mx, n = _mape(sel)
        base = {k: _mape(sel, k)[0] for k in Study.BASELINES}
        mem = [abs(c.mem_error) for c in sel if c.mem_error is not None]
        verdicts = [c.verdict_right for c in sel if c.verdict_right is not None]
        out[name] = {"mape": m, "max": mx, "n": n, "per_setting": per, "baselines": base,
                     "memory_mape": statistics.mean(mem) if mem else float("nan"),
                     "memory_max": max(mem) if mem else float("nan"),
                     "verdicts_right": sum(verdicts), "verdicts": len(verdicts)}
    return out


def dist_summary(cases: list[CaseResult]) -> list[dict[str, Any]]:
    """Per framework and kind, time and memory errors on shapes shared with calibration and held out."""
    out = []
    keys = sorted({(c.framework, c.kind) for c in cases if c.framework})
    for fw, kind in keys:
        sel = [c for c in cases if (c.framework, c.kind) == (fw, kind) and c.status == "ok"]
        row: dict[str, Any] = {"framework": fw, "kind": kind,
                               "settings": sorted({c.setting for c in sel})}
        for part in ("calibration", "holdout"):
            cs = [c for c in sel if c.shape_split == part]
            m, mx, n = _mape(cs)
            mem = [abs(c.mem_error) for c in cs if c.mem_error is not None]
            row[part] = {"mape": m, "max": mx, "n": n, "memory_mape": statistics.mean(mem) if mem else float("nan"),
                         "memory_max": max(mem) if mem else float("nan")}
        out.append(row)
    return out


def dist_markdown(cases: list[CaseResult]) -> list[str]:
    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.1f}%"

    L = ["", "## Distributed runs (2 x H200, NVLink, one host; Megatron-Core also on 1)", "",
         "Real training iterations of HuggingFace Llama-3-8B and Qwen2-7B shapes cut to 4 layers (4096 tokens, "
         "micro-batch 1) under the stacks users run (`make validate-dist`, collector/dist_validate.py; "
         "`mcore_1gpu`: `make validate-dist NGPU=1`, Megatron-Core's own step on one GPU): PyTorch "
         "DDP, FSDP2, DTensor tensor parallel with Megatron semantics (with and without sequence parallel) and "
         "torch.distributed.pipelining; Megatron-Core 0.19.2 (local layer spec: no Transformer Engine). The "
         "iteration is the slowest rank's median; memory is the largest per-rank peak.", "",
         "No constant is fitted to these runs: communication comes from the measured NCCL tables, the "
         "interference of concurrent NCCL and compute from the overlap campaign, framework host costs from "
         "host-bound runs of a tiny model (data/h200/framework/), everything else from the operator database. "
         "`shared` cases are the Llama-3-8B shape, whose exact operator calls are in the database (from the "
         "one-GPU calibration and Megatron signature campaigns); `held out` cases are the Qwen2-7B shape "
         "(grid points only, never used to fit or choose anything numeric). The framework models were written "
         "with both shapes' results visible.", "",
         "| framework | kind | settings | time MAPE shared (n) | held out (n) | max held out | memory MAPE shared | "
         "held out |", "|---|---|---|---|---|---|---|---|"]
    for r in dist_summary(cases):
        a, b = r["calibration"], r["holdout"]
        L.append(f"| {r['framework']} | {r['kind']} | {', '.join(r['settings'])} | {pct(a['mape'])} ({a['n']}) | "
                 f"{pct(b['mape'])} ({b['n']}) | {pct(b['max'])} | {pct(a['memory_mape'])} | "
                 f"{pct(b['memory_mape'])} |")
    L += ["", "| case | measured ms | predicted ms | error | host issue ms (slowest rank) | peak GiB meas / pred |",
          "|---|---|---|---|---|---|"]
    for c in sorted(cases, key=lambda c: (c.framework, c.kind, c.case_id)):
        host = f"{c.host_ms:.1f}" if c.host_ms else "-"
        if c.status != "ok":
            L.append(f"| {c.case_id} | {c.status} | - | - | - | - |")
            continue
        L.append(f"| {c.case_id} | {c.measured_ms or 0:.2f} | {c.predicted_ms or 0:.2f} | "
                 f"{100 * (c.signed or 0):+.1f}% | {host} | {c.measured_peak_gib or 0:.1f} / "
                 f"{c.predicted_peak_gib or 0:.1f} |")
    return L


def family_markdown(cases: list[CaseResult], families_campaign: bool = True) -> list[str]:
    """One-GPU errors per family of the spec registry (time and peak memory); families_campaign: whether the database
    holds the families' campaign (the reference GPU's does; elsewhere the generic grid prices them, with whatever
    gap-filling campaigns that database holds)."""
    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.1f}%"

    one = [c for c in cases if c.split in ("calibration", "holdout") and c.family]
    fams = sorted({c.family for c in one})
    if not fams:
        return []
    L = ["", "## Per model family (one GPU)", "",
         "Families built from transformers' own modules (everything but llama and gpt2) are held out of every "
         "fitted constant, and " + (
             "their operator calls were profiled at other sequence lengths than the cases "
             "(data/h200/campaigns/families.jsonl: half and twice each case's), so their shapes are interpolated. "
             if families_campaign else "this database holds no campaign of the families' calls: the generic grid prices "
             "every case (with the database's gap-filling campaigns at other lengths, if any). ") + "Model types the spec registry does not list (gemma, gpt_oss, granite, olmo2, starcoder2: built as "
         "transformers builds them, `ArchFamily.TRANSFORMERS`) were measured after that path was written, with "
         "no campaign of their operator calls: the generic grid alone prices them. "
         "MoE cases assume balanced routing (random-weight routers are close to it).", "",
         "| family | cases | settings | MAPE | max APE | memory max error |", "|---|---|---|---|---|---|"]
    for f in fams:
        sel = [c for c in one if c.family == f]
        m, mx, n = _mape(sel)
        mem = [abs(c.mem_error) for c in sel if c.mem_error is not None]
        settings = ", ".join(sorted({c.setting for c in sel}))
        L.append(f"| {f} | {n} | {settings} | {pct(m)} | {pct(mx)} | {pct(max(mem)) if mem else 'n/a'} |")
    return L


def instance_markdown(cases: list[CaseResult], instances: list[dict[str, Any]]) -> list[str]:
    """The measured host instances: their CPU, host costs, and the runs measured on each against predictions
    made with that instance's own host costs."""
    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.1f}%"

    ops = [i["per_op_us"] for i in instances]
    tpx = [i["tp_extra_ms"] for i in instances]
    L = ["", "### Machine instances (host-bound work)", "",
         f"Instances of one lent machine kind differ in host speed: eager PyTorch spent {min(ops):.1f} to "
         f"{max(ops):.1f} us per forward operator and DTensor's dispatch {min(tpx):.1f} to {max(tpx):.1f} ms more "
         "per decoder layer (forward and backward) on the instances measured, so host-bound runs (DTensor TP "
         "at 4 layers, GPT-2 small) change by up to 1.5x between instances while GPU-bound runs agree within "
         "1-2%. Host costs are therefore measured per instance (`make validate-dist` "
         "with `--machine-sample`, beside the tiny-model host probe); cases `<case>@<instance>` ran on that "
         "instance and are predicted with its own host costs (no constant comes from its runs). Rows without "
         "an instance were measured before instances were told apart, and are predicted with the host probe of "
         "that period (`first`), which need not be the instance they ran on. A user's prediction takes the "
         "typical host (each host cost the median over the measured instances: the instance a job is most "
         "likely to get) and states the step's range over the instances.", "",
         "| instance | CPU | eager host us/op (fwd, bf16) | DTensor TP extra ms/layer (fwd+bwd, bf16) | runs | "
         "time MAPE | max |", "|---|---|---|---|---|---|---|"]
    for inst in instances:
        mine = [c for c in cases if (c.machine or "first") == inst["machine"] and c.status == "ok"
                and c.split == "distributed" and c.ape is not None] if inst["machine"] != "first" else []
        mine += [c for c in cases if c.machine == inst["machine"] and c.split != "distributed" and c.ape is not None]
        m, mx, n = _mape(mine)
        L.append(f"| {inst['machine']} | {inst['cpu'] or '-'} | {inst['per_op_us']:.1f} | "
                 f"{inst['tp_extra_ms']:.1f} | {n} | {pct(m)} | {pct(mx)} |")
    same = [c for c in cases if c.machine and c.split == "distributed"]
    if same:
        L += ["", "Distributed kinds, runs measured with their instance's host costs only:", "",
              "| framework | kind | time MAPE shared (n) | held out (n) | max held out |", "|---|---|---|---|---|"]
        for r in dist_summary(same):
            a, b = r["calibration"], r["holdout"]
            L.append(f"| {r['framework']} | {r['kind']} | {pct(a['mape'])} ({a['n']}) | {pct(b['mape'])} ({b['n']}) "
                     f"| {pct(b['max'])} |")
    user = [c for c in cases if c.machine and c.status == "ok" and c.ape is not None and c.user_ape is not None]
    if user:
        L += ["", "As a user's prediction is made: runs of a known instance predicted with the typical host of the "
              "other instances (each host cost the median over them; the run's own instance left out), against "
              "the same runs predicted with their own instance's costs:", "",
              "| runs | n | MAPE, typical host of the others | max | MAPE, own instance | max |",
              "|---|---|---|---|---|---|"]
        groups = [("one GPU", [c for c in user if c.split != "distributed"])]
        groups += [(f"{fw} {k}", [c for c in user if c.framework == fw and c.kind == k])
                   for fw, k in sorted({(c.framework, c.kind) for c in user if c.split == "distributed"})]
        groups.append(("distributed, all", [c for c in user if c.split == "distributed"]))
        for name, sel in groups:
            if not sel:
                continue
            ua = [c.user_ape for c in sel if c.user_ape is not None]
            oa = [c.ape for c in sel if c.ape is not None]
            L.append(f"| {name} | {len(sel)} | {pct(sum(ua) / len(ua))} | {pct(max(ua))} | "
                     f"{pct(sum(oa) / len(oa))} | {pct(max(oa))} |")
    return L


def report_markdown(cases: list[CaseResult], host: HostModel, summ: dict[str, Any], plot_file: str,
                    provenance: dict[str, Any], instances: list[dict[str, Any]] | None = None, *,
                    fitted: bool = True, validation_dir: str = "data/validation/",
                    database_dir: str = "data/h200/", has_calibration: bool = True, calibrated: bool = True,
                    families_campaign: bool = True) -> str:
    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.1f}%"

    rest = ("the rest fitted on the calibration split only (its runs whose instance's host costs were measured, "
            "each predicted with them), from fixed defaults within bounds: " if fitted else
            "the rest as the database's calibration.json gives them (not fitted by this report): " if has_calibration
            else "the rest the engine's fixed defaults (the database has no calibration.json; not fitted): ")
    per_op = (f"per-operator forward, backward and optimizer host costs measured on host-bound runs "
              f"({database_dir.rstrip('/')}/framework/, not fitted; an operator that launches no kernel charged apart "
              f"from one that does where the chain probe ran, and the forward's module Python charged once per "
              f"decoder layer where its tight-loop slopes are known); " if instances else
              f"per-operator host costs the engine's fixed defaults (forward {host.fwd_us:g}, backward {host.bwd_us:g}, "
              f"optimizer {host.opt_us:g} us: no host of this GPU was probed); ")
    L = ["# Validation: predictions against measured training iterations", "",
         f"Generated by `make report` (`tp-query report`) from the measurements in `{validation_dir}` "
         f"and the operator database in `{database_dir}`. Do not edit by hand.", "",
         f"GPU: {provenance.get('gpu_name', '?')} (driver {provenance.get('driver', '?')}, CUDA "
         f"{provenance.get('cuda', '?')}, torch {provenance.get('torch', '?')}, cuDNN {provenance.get('cudnn', '?')}).",
         "Each case is a real HuggingFace training iteration (forward with labels, loss, backward, AdamW step, "
         "zero_grad; GradScaler under amp_fp16) timed with CUDA events over iterations after warm-up.", "",
         "Host model: " + per_op + rest
         + ", ".join(f"{k}={v:.3g}" for k, v in asdict(host).items() if k not in ("fwd_us", "bwd_us", "opt_us", "fwd_view_us", "bwd_view_us", "fwd_layer_us")),
         *([] if calibrated else ["", "This database holds no campaign of the calibration cases' own operator calls "
                                  "(the generic grid, and gap-filling campaigns at other lengths if any): every run "
                                  "is held out, those the reference GPU calibrates on included."]),
         "", "## Summary", "",
         "`all` is every one-GPU case. `distributed` are runs over several GPUs (see the section below).", "",
         "| split | cases | MAPE | max APE | static-TF32 baseline | static-BF16 baseline | memory MAPE | fits/OOM right |",
         "|---|---|---|---|---|---|---|---|"]
    for split in SPLITS:
        s = summ[split]
        if not s["n"] and not s["verdicts"]:
            continue
        L.append(f"| {split} | {s['n']} | {pct(s['mape'])} | {pct(s['max'])} | {pct(s['baselines']['static-tf32'])} "
                 f"| {pct(s['baselines']['static-bf16'])} | {pct(s['memory_mape'])} | "
                 f"{s['verdicts_right']}/{s['verdicts']} |")
    L += ["", "## MAPE per precision setting (one GPU)", "", "| setting | calibration | holdout | all |",
          "|---|---|---|---|"]
    for st in Setting:
        row = [f"{pct(summ[sp]['per_setting'][st.value]['mape'])} (n={summ[sp]['per_setting'][st.value]['n']})"
               for sp in ("calibration", "holdout", "all")]
        L.append(f"| {st.value} | " + " | ".join(row) + " |")
    L += family_markdown(cases, families_campaign)
    dist_cases = [c for c in cases if c.split == "distributed"]
    if dist_cases:
        L += dist_markdown(dist_cases)
    if instances:
        L += instance_markdown(cases, instances)
    prof = [c for c in cases if c.kernel_ms and c.measured_ms and c.predicted_ms]
    if prof:
        L += ["", "## Where the time goes (torch.profiler on a few cases)", "",
              "The profiler's GPU span (first kernel start to last kernel end of one iteration) against the "
              "measured iteration, and the prediction split into GPU time and host overhead. The per-class kernel "
              "times are the profiler's attribution by kernel name; they sum over overlapping events (the sum "
              "can exceed the span), so they are indicative only.", "",
              "| case | measured ms | profiler GPU span ms | predicted ms | predicted GPU ms | predicted host ms | "
              "kernel classes (profiler, ms) |", "|---|---|---|---|---|---|---|"]
        for c in prof:
            assert c.measured_ms and c.kernel_ms and c.predicted_ms
            host_ms = c.breakdown.get("host_overhead_ms", 0.0)
            cls = c.kernel_breakdown.get("kernel_ms_by_class", {})
            cl = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cls.items(), key=lambda kv: -kv[1]) if v >= 0.5)
            span = c.kernel_breakdown.get("gpu_span_ms", 0.0)
            L.append(f"| {c.case_id} | {c.measured_ms:.1f} | {span:.1f} | {c.predicted_ms:.1f} | "
                     f"{c.predicted_ms - host_ms:.1f} | {host_ms:.1f} | {cl} |")
    L += ["", "Notes on the remaining error: [validation-notes.md](validation-notes.md).", ""]
    L += ["", f"![predicted vs measured]({plot_file})", "", "## Cases", "",
          "| case | split | measured ms | predicted ms | error | exact/interp/extrap/miss/host % | peak GiB meas/pred | fits pred / measured |",
          "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        src = c.sources
        srcs = "/".join(f"{100 * src.get(k, 0):.0f}" for k in ("exact", "interpolated", "extrapolated", "miss",
                                                                 "host-model"))
        meas = f"{c.measured_ms:.2f}" if c.measured_ms else c.status
        pred = f"{c.predicted_ms:.2f}" if c.predicted_ms else (c.error or "-")
        err = f"{100 * c.signed:+.1f}%" if c.signed is not None else "-"
        mem = (f"{c.measured_peak_gib:.1f} / {c.predicted_peak_gib:.1f}" if c.measured_peak_gib and c.predicted_peak_gib
               and c.status == "ok" else (f"- / {c.predicted_peak_gib:.1f}" if c.predicted_peak_gib else "-"))
        fits = f"{'fits' if c.predicted_fits else 'OOM'} / {'fits' if c.status == 'ok' else c.status}" \
            if c.predicted_fits is not None else "-"
        L.append(f"| {c.case_id} | {c.split} | {meas} | {pred} | {err} | {srcs} | {mem} | {fits} |")
    return "\n".join(L) + "\n"
