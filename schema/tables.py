"""Parquet table schemas of the profile database, and the provenance every file carries.

The database of one GPU type lives under data/<gpu>/: ops/*.parquet (operator latencies),
comm/*.parquet (collectives), and validation runs under data/validation/. Provenance is stored twice:
as columns (so SQL can filter and group by it) and as file metadata under the key `tp_query`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from .ops import FEATURE_COLUMNS

SCHEMA_VERSION = 1
COLLECTOR_VERSION = "0.2.0"  # 0.2.0: factories replayed on the device
METADATA_KEY = b"tp_query"

# The generic sweep's campaign name (`make collect --grid`); every other campaign measures exact calls of traced
# models (signature files, named by the file: data/<gpu>/campaigns/<name>.jsonl)
GRID_CAMPAIGN = "grid"
# The campaign of the calibration cases' own calls, at their shapes: only it makes those cases calibration shapes
# (the others fill gaps at other lengths: families, linear-attention, arch-gaps, ...)
CALIBRATION_CAMPAIGN = "calibration"
# The spec families' calls at half and twice each held-out case's length (their shapes interpolated)
FAMILIES_CAMPAIGN = "families"


@dataclass(frozen=True)
class Provenance:
    """Where a measurement came from. Part of every row and every file."""

    gpu: str  # normalised name: h200, h100, ...
    gpu_name: str  # as NVML reports it
    driver: str
    cuda: str
    torch: str
    cudnn: str
    collector_version: str = COLLECTOR_VERSION
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(s: str | bytes) -> Provenance:
        return Provenance(**json.loads(s))


PROVENANCE_FIELDS: list[pa.Field] = [
    pa.field("gpu", pa.string()), pa.field("gpu_name", pa.string()), pa.field("driver", pa.string()),
    pa.field("cuda", pa.string()), pa.field("torch", pa.string()), pa.field("cudnn", pa.string()),
    pa.field("collector_version", pa.string()), pa.field("schema_version", pa.int32()),
]

_FEATURE_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}

OPS_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),
        pa.field("op", pa.string()),
        pa.field("kind", pa.string()),
        pa.field("family", pa.string()),
        pa.field("precision", pa.string()),
        pa.field("math_mode", pa.string()),
        pa.field("dtypes", pa.string()),
        pa.field("signature", pa.string()),
    ]
    + [pa.field(name, _FEATURE_TYPES[t]) for name, t in FEATURE_COLUMNS.items()]
    + [
        pa.field("flops", pa.float64()),
        pa.field("bytes", pa.float64()),
        pa.field("latency_us", pa.float64()),  # median, L2 flushed before every sample
        pa.field("p20_us", pa.float64()),
        pa.field("p80_us", pa.float64()),
        pa.field("min_us", pa.float64()),
        pa.field("samples", pa.int32()),
        pa.field("latency_warm_us", pa.float64()),  # median back-to-back (CUDA graph), L2 warm
        pa.field("warm_samples", pa.int32()),
        pa.field("method", pa.string()),  # events | graph | cpu-wall
        pa.field("status", pa.string()),  # ok | unsupported | oom | error
        pa.field("reason", pa.string()),
        pa.field("sm_clock_mhz", pa.int32()),
        pa.field("mem_clock_mhz", pa.int32()),
        pa.field("throttle", pa.int64()),  # NVML clock-event reasons bitmask, OR over the point
        pa.field("campaign", pa.string()),
        pa.field("run", pa.int32()),  # 1: first measurement; 2: repeat for the spread check
        pa.field("measured_at", pa.timestamp("ms", tz="UTC")),
    ]
    + PROVENANCE_FIELDS
)

VALIDATION_SCHEMA = pa.schema(
    [
        pa.field("case_id", pa.string()),
        pa.field("model", pa.string()),
        pa.field("config_json", pa.string()),
        pa.field("layers", pa.int32()),
        pa.field("setting", pa.string()),
        pa.field("micro_batch", pa.int32()),
        pa.field("seq_len", pa.int32()),
        pa.field("optimizer", pa.string()),
        pa.field("tp_shard", pa.int32()),  # the case runs the TP-shard-shaped model of this TP degree
        pa.field("accum", pa.int32()),  # micro-batches per optimizer step
        pa.field("dp", pa.int32()),  # distributed runs: the split (null for one GPU)
        pa.field("tp", pa.int32()),
        pa.field("pp", pa.int32()),
        pa.field("pp_stage", pa.string()),  # one stage of a PP split run alone: first | middle | last
        pa.field("split", pa.string()),  # calibration | holdout
        pa.field("framework", pa.string()),  # distributed runs: torch | megatron
        pa.field("dist_kind", pa.string()),  # ddp | ddp_bucket_view | fsdp_z3 | fsdp_z2 | tp | tp_sp | pp_* | mcore_*
        pa.field("options_json", pa.string()),
        pa.field("status", pa.string()),  # ok | oom | error
        pa.field("reason", pa.string()),
        pa.field("iteration_ms", pa.float64()),  # median over timed iterations
        pa.field("p20_ms", pa.float64()),
        pa.field("p80_ms", pa.float64()),
        pa.field("iterations", pa.int32()),
        pa.field("samples_ms", pa.list_(pa.float64())),
        pa.field("peak_allocated_bytes", pa.int64()),
        pa.field("peak_reserved_bytes", pa.int64()),
        pa.field("rank_json", pa.string()),  # distributed runs: each rank's median and peak
        pa.field("kernel_ms", pa.float64()),  # sum of kernel time in one profiled iteration (when profiled)
        pa.field("kernel_breakdown_json", pa.string()),
        pa.field("sm_clock_mhz", pa.int32()),
        pa.field("measured_at", pa.timestamp("ms", tz="UTC")),
    ]
    + PROVENANCE_FIELDS
    # the machine instance the run was measured on (collector.device.machine_id) and its CPU: its own host costs
    # predict it. Runs written before these columns read them as null (engine.validation says which host then).
    + [pa.field("machine", pa.string()), pa.field("cpu", pa.string())]
)

OPLOG_SCHEMA = pa.schema(
    [pa.field("case_id", pa.string()), pa.field("setting", pa.string()), pa.field("phase", pa.string()), pa.field("op", pa.string()), pa.field("signature", pa.string()), pa.field("count", pa.int32()), *PROVENANCE_FIELDS]
)

COMM_SCHEMA = pa.schema(
    [pa.field("collective", pa.string()), pa.field("bytes", pa.int64()), pa.field("ranks", pa.int32()), pa.field("dtype", pa.string()), pa.field("link", pa.string()), pa.field("latency_us", pa.float64()), pa.field("p20_us", pa.float64()), pa.field("p80_us", pa.float64()), pa.field("samples", pa.int32()), pa.field("bus_bw_gbps", pa.float64()), pa.field("status", pa.string()), pa.field("reason", pa.string()), pa.field("measured_at", pa.timestamp("ms", tz="UTC")), *PROVENANCE_FIELDS]
)


# A communication/computation pair run concurrently on one GPU (NCCL on its own stream): how much each
# slows the other. The engine prices overlapped communication with these, not with a fixed factor.
OVERLAP_SCHEMA = pa.schema(
    [pa.field("compute", pa.string()), pa.field("compute_dtype", pa.string()), pa.field("collective", pa.string()),
     pa.field("bytes", pa.int64()), pa.field("ranks", pa.int32()), pa.field("compute_alone_us", pa.float64()),
     pa.field("compute_concurrent_us", pa.float64()), pa.field("comm_alone_us", pa.float64()),
     pa.field("comm_concurrent_us", pa.float64()), pa.field("status", pa.string()), pa.field("reason", pa.string()),
     pa.field("measured_at", pa.timestamp("ms", tz="UTC")), *PROVENANCE_FIELDS]
)

# Host-side costs of a framework (microseconds), measured on host-bound runs of a tiny model: the slope per
# decoder layer and the fixed part per micro-batch of each phase, beyond plain eager PyTorch.
FRAMEWORK_SCHEMA = pa.schema(
    [pa.field("framework", pa.string()), pa.field("kind", pa.string()), pa.field("setting", pa.string()),
     pa.field("phase", pa.string()),
     pa.field("quantity", pa.string()), pa.field("value_us", pa.float64()), pa.field("ranks", pa.int32()),
     pa.field("samples_json", pa.string()), pa.field("status", pa.string()), pa.field("reason", pa.string()),
     pa.field("measured_at", pa.timestamp("ms", tz="UTC")), *PROVENANCE_FIELDS,
     # the machine instance (collector.device.machine_id): host costs differ between instances of one kind;
     # each instance keeps its rows and the engine takes the median over instances (null: the first one)
     pa.field("machine", pa.string()), pa.field("cpu", pa.string())]
)


# Each database table's schema (its folder's name), and the columns added after schema version 1 that files
# written before them lack (read as null: the op rows' attention mask and grouped-GEMM group count, the framework
# rows' machine instance). Any other column missing or of another type makes a file foreign.
TABLE_SCHEMAS: dict[str, pa.Schema] = {"ops": OPS_SCHEMA, "comm": COMM_SCHEMA, "overlap": OVERLAP_SCHEMA,
                                       "framework": FRAMEWORK_SCHEMA}
LATER_COLUMNS: dict[str, frozenset[str]] = {"ops": frozenset({"masked", "groups"}),
                                            "framework": frozenset({"machine", "cpu"})}


def schema_refusal(table: str, schema: pa.Schema) -> str:
    """Why a file's schema is not its table's ("" when it is): a column missing (other than one added later) or
    of another type, or a column the table does not have."""
    want = TABLE_SCHEMAS.get(table)
    if want is None:
        return ""
    for f in want:
        i = schema.get_field_index(f.name)
        if i < 0:
            if f.name not in LATER_COLUMNS.get(table, frozenset()):
                return f"it has no {f.name} column"
        elif schema.field(i).type != f.type:
            return f"its {f.name} column is {schema.field(i).type}, not {f.type}"
    extra = [n for n in schema.names if want.get_field_index(n) < 0]
    return f"it has columns the {table} table does not ({', '.join(extra[:3])})" if extra else ""


def provenance_columns(p: Provenance) -> dict[str, Any]:
    return asdict(p)
