"""Reading a suite file: TOML → a Suite of RunSpecs (bench.spec), or every problem at once.

Validation follows torchtune's habit: collect every problem, then raise once with all of them, each
naming the file, the key path and what is allowed. Nothing runs until a suite loads cleanly.
"""

from __future__ import annotations

import fnmatch
import re
import signal
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from bench.data import varlen
from bench.errors import SuiteError, cannot_read
from bench.hub import HubError
from bench.models import ModelSpec
from bench.registry import did_you_mean
from bench.spec import (
    DEFAULTS,
    DEVICES,
    HF,
    MAX_NPROC,
    STEP_KEYS,
    RunSpec,
    Shapes,
    Suite,
    TechniqueSpec,
    hf_config_file,
)
from bench.suite import fidelity_table, quantized, training_args
from bench.suite.schema import MATRIX, RUNS, SHAPES, TOP, read, unknown
from bench.suite.techniques import check_fidelity_batch, techniques
from bench.suite.toml_text import toml_value
from bench.suite.values import check_ranges, model_spec, typed, weights
from bench.techniques import Technique, build

# bytes: a record's file name, its slug and digest, and '.snapshot.pickle' stay under 255
MAX_RUN_NAME = 120
SUITE_NAME = re.compile(r"\w[\w.-]*")  # any script's letters; no separators, no leading dot


def load(path: str | Path) -> Suite:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))  # whatever the locale says (LC_ALL=C)
    except OSError as exc:
        raise cannot_read(path, exc.strerror or str(exc)) from None
    except UnicodeDecodeError as exc:
        raise SuiteError(
            path,
            [
                f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}; save "
                "the file as UTF-8"
            ],
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SuiteError(path, [f"TOML syntax: {exc}"]) from None
    problems: list[str] = []
    with _limited(path):
        suite = _build(path, raw, problems)
    if problems:
        raise SuiteError(path, problems)
    return suite


# importing a user's module and building its techniques: a hang there once waited forever
LOAD_LIMIT_S = 120


@contextmanager
def _limited(path: Path) -> Iterator[None]:
    """Loading stopped after LOAD_LIMIT_S with the reason, where it can be (the main thread:
    SIGALRM): a model or technique module of the user's that hangs on import, or a constructor that
    never returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SuiteError(
            path,
            [
                f"loading took more than {LOAD_LIMIT_S} s: a module it imports (a model or "
                "technique named module:NAME) or a technique's constructor does not return; run "
                "`python -c 'import MODULE'` to see where it hangs"
            ],
        )

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(LOAD_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def select(suite: Suite, patterns: list[str]) -> Suite:
    """The runs matching any of the names or globs, always with the baselines they are compared
    with; a pattern that matches nothing (a typo) or is empty is refused, naming the runs."""
    names = [r.name for r in suite.runs]
    unmatched = [p for p in patterns if not p.strip() or not fnmatch.filter(names, p)]
    if unmatched or not patterns:
        reason = (
            "; ".join(f"{p!r} matches no run{did_you_mean(p, names)}" for p in unmatched)
            or "no pattern given"
        )
        raise SuiteError(
            suite.path, [f"--only {','.join(patterns)}: {reason}; runs: {', '.join(names)}"]
        )
    chosen = {r.name for r in suite.runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)}
    chosen |= {r.baseline for r in suite.runs if r.name in chosen}
    return replace(
        suite,
        runs=tuple(r for r in suite.runs if r.name in chosen),
        order=suite.order or tuple(r.name for r in suite.runs),
    )


def spanning(suite: Suite, nproc: int) -> Suite:
    """Every entry with a distributed technique spanning ``nproc`` processes (``bench predict
    --nproc``); the others stay in one."""
    return replace(
        suite, runs=tuple(replace(r, nproc=nproc) if r.nproc > 1 else r for r in suite.runs)
    )


ZERO_STAGES = (1, 2, 3)  # the stages that shard: optimizer state, then gradients, then parameters


def zero_stages(suite: Suite) -> Suite:
    """Every DeepSpeed entry at each ZeRO stage that shards, its own and the others after it
    (``bench predict --zero-stages``), named ``<run>-zero<stage>``: each answers the same
    questions (with ``--card``, the fewest such cards). ``offload_param``, ZeRO-3's alone, is
    left out below stage 3; the others run as they are."""
    runs = []
    for run in suite.runs:
        runs.append(run)
        ds = next((t for t in run.techniques if t.name == "deepspeed"), None)
        if ds is None:
            continue
        options, own_stage = dict(ds.options), build(ds).config.stage
        for stage in ZERO_STAGES:
            if stage == own_stage:
                continue
            own = options | {"stage": stage}
            if stage < 3:
                own = {k: v for k, v in own.items() if not k.startswith("offload_param")}
            staged = TechniqueSpec(ds.name, tuple(sorted(own.items())))
            techniques = tuple(staged if t is ds else t for t in run.techniques)
            runs.append(replace(run, name=f"{run.name}-zero{stage}", techniques=techniques))
    return replace(suite, runs=tuple(runs))


def varlen_steps(suite: Suite, **shapes: bool | str) -> Suite:
    """Every run on variable-length data with its GPU shapes' ``shapes`` set: taking its epoch's
    worst batch alone (``worst_step``, ``bench predict --worst-step``) or every batch of it in
    order (``epoch``, ``--epoch``); the others, whose steps are all alike, as they are."""
    return replace(
        suite,
        runs=tuple(
            replace(r, gpu=replace(r.gpu, **shapes)) if r.gpu.lengths else r for r in suite.runs
        ),
    )


def with_timeout(suite: Suite, seconds: float) -> Suite:
    """Every run stopped after ``seconds`` (``--timeout``): the limit is not part of a run's key, so
    a record kept before stays kept."""
    return replace(suite, runs=tuple(replace(r, timeout_s=seconds) for r in suite.runs))


def without_fidelity(suite: Suite) -> Suite:
    """Every run without its fidelity phase (``--no-fidelity``): memory and speed only, sooner. The
    runs are keyed as entries with ``fidelity = false``, so a record made with the phase is not
    taken for one without."""
    return replace(
        suite, runs=tuple(replace(r, fidelity_gpu=None, fidelity_cpu=None) for r in suite.runs)
    )


def _build(path: Path, raw: dict[str, Any], problems: list[str]) -> Suite:
    unknown(raw, TOP, "", problems)
    name = _name(raw, path, problems)
    model = read(raw, "model", TOP, problems)
    if model is None:
        problems.append(f"model: required; {TOP['model'].doc}")
    spec = model_spec(model, "model", problems)
    suite_weights = weights(raw, "", problems)
    mode = read(raw, "mode", TOP, problems)
    common = {k: read(raw, k, TOP, problems) for k in DEFAULTS}
    check_ranges(common, "", problems)
    steps = {k: common.pop(k) for k in STEP_KEYS}
    shapes = _shapes(raw.get("shapes"), spec, steps=steps, problems=problems, mode=mode)
    if mode == "generate":
        _check_generation(raw, spec, problems)
    entries = _entries(raw, problems)
    baseline = _baseline(raw, entries, problems)
    fidelity = fidelity_table.parse(raw.get("fidelity"), model, spec, suite_weights, problems)
    if shapes is not None:
        _check_matrix_lengths(raw.get("matrix"), shapes, problems)
    loaded = _saved_quantized(model, problems)
    runs = []
    for e in entries:
        specs = techniques(e.techniques, e.where, e.batch, shapes, mode, problems)
        if shapes is None or specs is None or spec is None or baseline is None:
            continue  # already reported; keep collecting problems from the other entries
        if loaded and not any(t.name == loaded["name"] for t in specs):
            problems.append(
                f"{e.where}: model {model} is saved quantized, and loads so whatever the job says: "
                f"name the technique its config.json's quantization_config loads it with first, "
                f"{toml_value(loaded)}"
            )
        check_fidelity_batch(specs, fidelity, e.where, problems)
        nproc = _nproc(e, specs, problems)
        gpu, cpu = (
            replace(
                shapes[d],
                **({"batch_size": e.batch[d]} if e.batch else {}),
                **({"seq_len": e.seq_len[d]} if e.seq_len else {}),
                **({"lengths": e.lengths[d]} if e.lengths else {}),
            )
            for d in DEVICES
        )
        problem = f"matrix.seq_len: model {spec.name} takes images; seq_len is a token model's"
        if e.seq_len and spec.inputs != "tokens" and problem not in problems:
            problems.append(problem)
        _check_data(specs, spec, gpu=gpu, cpu=cpu, where=e.where, problems=problems)
        if baseline in _matrix_keys(entries):
            base = f"{baseline}{e.suffix}"
        else:
            base = baseline
        # The fidelity phase trains in one process: a distributed run has none.
        fid = {
            f"fidelity_{d}": fidelity.get(d) if e.fidelity and nproc == 1 else None for d in DEVICES
        }
        runs.append(
            RunSpec(
                suite=name,
                name=e.name,
                model=model,
                techniques=specs,
                gpu=gpu,
                cpu=cpu,
                baseline=base,
                **common,
                mode=mode,
                **fid,
                nproc=nproc,
                weights=suite_weights,
            )
        )
    description = read(raw, "description", TOP, problems)
    throughput = read(raw, "throughput", TOP, problems)
    first = _first_look(raw, [r.name for r in runs], problems)
    return Suite(
        name=name,
        path=path,
        model=model or "",
        description=description,
        baseline=baseline or "",
        runs=tuple(runs),
        throughput=throughput,
        first_look=first,
    )


def _first_look(raw: dict[str, Any], names: list[str], problems: list[str]) -> tuple[str, ...]:
    """The runs a CPU measures unless --all: each pattern must name a run (a typo would leave it
    out)."""
    patterns = read(raw, "first_look", TOP, problems)
    if not all(isinstance(p, str) for p in patterns):
        problems.append(f"first_look: expected a list of run names, got {patterns!r}")
        return ()
    for p in patterns:
        if names and not fnmatch.filter(names, p):
            problems.append(f"first_look: {p!r} matches no run{did_you_mean(p, names)}")
    return tuple(patterns)


def _name(raw: dict[str, Any], path: Path, problems: list[str]) -> str:
    """The suite's name, which names its folder under results/: a plain folder name, never a
    path."""
    name = typed(raw, "name", kind=TOP["name"].kind, default=path.stem, problems=problems)
    if not SUITE_NAME.fullmatch(name) or name in (".", ".."):
        if "name" in raw:
            given = "name"
        else:
            given = f"name (from the file name {path.name!r})"
        problems.append(
            f"{given}: {name!r} cannot name a folder under results/; use letters, digits, '.', '_' "
            "and '-', starting with a letter or digit, e.g. name = \"my-suite\""
        )
    return name


def _nproc(entry: Entry, specs: tuple[TechniqueSpec, ...], problems: list[str]) -> int:
    """Processes for the run: as written, else 2 where a technique is distributed; checked both
    ways."""
    distributed = [t.name for t in specs if build(t).distributed]
    nproc = entry.nproc or (2 if distributed else 1)
    where = entry.where.removesuffix(".techniques")
    if distributed and nproc < 2:
        problems.append(f"{where}.nproc: {distributed[0]} needs at least 2 processes, got {nproc}")
    if not distributed and nproc > 1:
        problems.append(
            f"{where}.nproc: {nproc} processes without ddp, fsdp or tensor-parallel would train "
            "independent copies; add one of them or remove nproc"
        )
    return nproc


def _matrix_keys(entries: list[Entry]) -> set[str]:
    return {e.key for e in entries if e.suffix}


def _check_data(
    specs: tuple[TechniqueSpec, ...],
    model: ModelSpec,
    gpu: Shapes,
    cpu: Shapes,
    where: str,
    problems: list[str],
) -> None:
    """Techniques that need a kind of input, and those that form batches from variable-length
    data."""
    for t in specs:
        technique = build(t)
        if technique.inputs is not None and technique.inputs != model.inputs:
            problems.append(
                f"{where}: {t.name} applies to models that take {technique.inputs}; model "
                f"{model.name} takes {model.inputs}"
            )
        elif (
            type(technique).batching is not Technique.batching
            and type(technique).fixed is Technique.fixed
            and (gpu.lengths is None or cpu.lengths is None)
        ):
            problems.append(
                f"{where}: {t.name} forms batches from variable-length data; set lengths in "
                "[shapes.gpu] and [shapes.cpu], or name distributions in [matrix.lengths]"
            )
        elif (
            type(technique).fixed is not Technique.fixed
            and (gpu.lengths or cpu.lengths)
            and any(build(s).batch_multiple() > 1 for s in specs)  # micro-batches
        ):
            problems.append(
                f"{where}: {t.name} with micro-batches on variable-length data: each micro-batch's "
                "packed row has its own length, and rows of unequal tokens cannot be stacked; "
                "accumulate over packed batches of fixed-shape sequences (no lengths)"
            )


def _lengths(value: Any, seq_len: int | None, where: str, problems: list[str]) -> str | None:
    """A length distribution as written, checked: a known form whose longest sequence fits
    seq_len."""
    if not isinstance(value, str):
        problems.append(f"{where}: expected a string ({varlen.FORMS}), got {value!r}")
        return None
    try:
        top = varlen.parse(value).maximum
    except ValueError as exc:  # a DataError too: a dataset that cannot be read
        problems.append(f"{where}: {exc}")
        return value  # reported; kept so that the runs do not also read as having no lengths
    if seq_len is not None and top > seq_len:
        problems.append(
            f"{where}: {value!r} reaches {top} tokens, beyond seq_len = {seq_len}; lower its "
            "maximum or raise seq_len"
        )
    return value


def _check_matrix_lengths(raw: Any, shapes: dict[str, Shapes], problems: list[str]) -> None:
    if isinstance(raw, dict):
        table = raw.get("lengths")
    else:
        table = None
    for name, per_device in table.items() if isinstance(table, dict) else ():
        for dev in DEVICES if isinstance(per_device, dict) else ():
            _lengths(
                per_device.get(dev), shapes[dev].seq_len, f"matrix.lengths.{name}.{dev}", problems
            )


def _baseline(raw: dict[str, Any], entries: list[Entry], problems: list[str]) -> str | None:
    baseline = read(raw, "baseline", TOP, problems)
    names = {e.name for e in entries}
    if baseline is None:
        problems.append("baseline: required; the name of a run (or matrix key) to compare against")
    elif baseline not in names | _matrix_keys(entries):
        problems.append(
            f"baseline: {baseline!r} is not a run name or matrix key; runs: "
            f"{', '.join(sorted(names))}"
        )
        return None
    return baseline


DATA_KEYS = ("lengths", "loader_workers", "pin_memory")
# mode = "generate": [shapes.*] gives these, not seq_len
GENERATION_KEYS = (
    "prompt_len",
    "new_tokens",
)


def _shapes(
    raw: Any,
    spec: ModelSpec | None,
    steps: dict[str, int],
    problems: list[str],
    mode: str = "train",
) -> dict[str, Shapes] | None:
    if not isinstance(raw, dict):
        problems.append("shapes: required table with [shapes.gpu] and [shapes.cpu]")
        return None
    for key in raw.keys() - set(DEVICES):
        problems.append(f"shapes.{key}: unknown device; allowed: gpu, cpu")
    need: tuple[str, ...] = ()
    if spec is not None:
        if mode == "generate":
            need = GENERATION_KEYS
        else:
            need = spec.shape_keys
    out = {}
    for dev in DEVICES:
        table = raw.get(dev)
        if not isinstance(table, dict):
            problems.append(
                f"shapes.{dev}: required table with batch_size and "
                f"{', '.join(need) or 'the model shapes'}"
            )
            continue
        allowed = ("batch_size", *need)
        if spec is not None and spec.inputs == "tokens":
            data = DATA_KEYS
        else:
            data = ()
        # else: reported
        for key in (
            table.keys() - {*allowed, *STEP_KEYS, *data, "model"} if spec is not None else ()
        ):
            problems.append(
                f"shapes.{dev}.{key}: unknown key for model {spec.name}; allowed: "
                f"{', '.join(allowed + STEP_KEYS + data + ('model',))}"
            )
        values = {
            key: read(table, key, SHAPES, problems, where=f"shapes.{dev}.") for key in allowed
        }
        bad = [k for k, v in values.items() if v is None or v <= 0]
        for key in bad:
            if values[key] is not None or key not in table:  # a wrong type is reported already
                problems.append(
                    f"shapes.{dev}.{key}: required positive integer, got {table.get(key)!r}"
                )
        own_steps = {
            k: typed(
                table, k, kind=SHAPES[k].kind, default=v, problems=problems, where=f"shapes.{dev}."
            )
            for k, v in steps.items()
        }
        check_ranges(own_steps, f"shapes.{dev}.", problems)
        stand_in = _stand_in(table, spec, f"shapes.{dev}.model", problems)
        if mode == "generate" and not bad:
            # the context the model holds: the prompt and what follows it
            values["seq_len"] = values["prompt_len"] + values["new_tokens"]
            if values["new_tokens"] < 2:
                problems.append(
                    f"shapes.{dev}.new_tokens: at least 2, got {values['new_tokens']}: the first "
                    "token comes from the prefill, and decoding is the tokens after it"
                )
        if not bad:
            out[dev] = Shapes(
                **values,
                **own_steps,
                **_data_keys(table, values.get("seq_len"), dev, problems),
                model=stand_in,
            )
    if len(out) == len(DEVICES):
        return out
    return None


def _check_generation(raw: dict[str, Any], spec: ModelSpec | None, problems: list[str]) -> None:
    """What generation needs that the file may lack: a causal language model, and no table it cannot
    use."""
    if spec is not None and spec.objective != "next-token":
        problems.append(
            "mode: generate needs a causal language model (a next-token objective); model "
            f"{spec.name} is trained for {spec.objective}"
        )
    if "fidelity" in raw:
        problems.append(
            "fidelity: generation has no fidelity phase yet; remove the [fidelity] table"
        )
    for key in ("seq_len", "lengths") if isinstance(raw.get("matrix"), dict) else ():
        if key in raw["matrix"]:
            problems.append(
                f"matrix.{key}: generation's lengths are [shapes.*] prompt_len and new_tokens"
            )


def _stand_in(
    table: dict[str, Any], spec: ModelSpec | None, where: str, problems: list[str]
) -> str | None:
    """The device's own model, in the suite's place: a known one that takes and predicts what the
    suite's does."""
    name = typed(
        table, "model", kind=str, default=None, problems=problems, where=where.removesuffix("model")
    )
    own = model_spec(name, where, problems)
    if own is None or spec is None:
        return None
    if (own.inputs, own.objective) != (spec.inputs, spec.objective):
        problems.append(
            f"{where}: {name} takes {own.inputs} for {own.objective}, model {spec.name} takes "
            f"{spec.inputs} for {spec.objective}; name a smaller model of the same kind"
        )
        return None
    return name


def _data_keys(
    table: dict[str, Any], seq_len: int | None, dev: str, problems: list[str]
) -> dict[str, Any]:
    """A token model's data path in [shapes.*]: a length distribution, the loader's workers, pinned
    memory."""
    where = f"shapes.{dev}."
    out = {
        k: read(table, k, SHAPES, problems, where=where) for k in ("loader_workers", "pin_memory")
    }
    if out["loader_workers"] < 0:
        problems.append(
            f"{where}loader_workers: must be 0 (load in the step's process) or more, got "
            f"{out['loader_workers']}"
        )
    if "lengths" in table:
        out["lengths"] = _lengths(table["lengths"], seq_len, f"{where}lengths", problems)
    return out


class Entry(NamedTuple):
    """A run as written in the file, before its techniques are checked."""

    name: str
    techniques: Any
    batch: dict[str, int] | None  # per-device batch sizes from the matrix, else None
    key: str  # the matrix key, or the run name
    where: str  # key path for messages
    fidelity: bool = True  # false: this entry skips the fidelity phase
    nproc: int | None = None  # processes, as written (None: 2 with a distributed technique, else 1)
    # per-device length distributions from the matrix, else None
    lengths: dict[str, str] | None = None
    suffix: str = ""  # what the matrix adds to the key: "@bs16", "@seq2048", "@digits"
    seq_len: dict[str, int] | None = None  # per-device sequence lengths from the matrix, else None


def _saved_quantized(model: str | None, problems: list[str]) -> dict[str, Any] | None:
    """The technique a Hugging Face model's config.json loads it with (its
    ``quantization_config``), or None."""
    if model is None or not model.startswith(HF):
        return None
    try:
        file = hf_config_file(model)
    except HubError:  # model_spec said why
        return None
    return quantized.loaded_as(file, problems)


def _entries(raw: dict[str, Any], problems: list[str]) -> list[Entry]:
    entries: list[Entry] = []
    runs = raw.get("runs", [])
    if not isinstance(runs, list):
        problems.append("runs: expected an array of [[runs]] tables")
        runs = []
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            problems.append(f"{where}: expected a table with name and techniques")
            continue
        unknown(run, RUNS, f"{where}.", problems)
        name = read(run, "name", RUNS, problems, where=f"{where}.")
        if name is None:
            problems.append(f"{where}.name: required string")
            continue
        fidelity = read(run, "fidelity", RUNS, problems, where=f"{where}.")
        nproc = read(run, "nproc", RUNS, problems, where=f"{where}.")
        if nproc is not None and not 1 <= nproc <= MAX_NPROC:
            problems.append(f"{where}.nproc: must be 1 to {MAX_NPROC:,}, got {nproc}")
        if "batch_size" in run:
            batch = _entry_batch(run["batch_size"], f"{where}.batch_size", problems)
        else:
            batch = None
        techniques = run.get("techniques", [])
        if "training_args" in run:
            job = _trainer_job(run, raw, f"{where}.training_args", problems)
            techniques, batch = (
                (job.techniques + list(techniques), job.batch) if job else (techniques, batch)
            )
        entries.append(
            Entry(
                name,
                techniques,
                batch=batch,
                key=name,
                where=f"{where}.techniques",
                fidelity=fidelity,
                nproc=nproc,
            )
        )
    if "matrix" in raw:
        entries += _matrix(raw["matrix"], problems)
    if not entries:
        problems.append("runs: the suite has no runs; add [[runs]] entries or a [matrix]")
    seen: set[str] = set()
    for name in (e.name for e in entries):
        if name in seen:
            problems.append(f"runs: duplicate run name {name!r}; names must be unique")
        # its record's file name (plus suffixes) must fit the file system's
        if len(name.encode()) > MAX_RUN_NAME:
            problems.append(
                f"runs: run name {name[:40]!r}… is {len(name.encode())} bytes; at most "
                f"{MAX_RUN_NAME}"
            )
        seen.add(name)
    return entries


class TrainerJob(NamedTuple):
    techniques: list[Any]
    batch: dict[str, int]


# the files whose ignored fields were named already in this process
_IGNORED_NAMED: set[str] = set()


def _trainer_job(
    run: dict[str, Any], raw: dict[str, Any], where: str, problems: list[str]
) -> TrainerJob | None:
    """A run's TrainingArguments file as its techniques (before the run's own) and its batch: on the
    GPU the Trainer's (per device, times the accumulation steps); on a CPU the suite's CPU batch,
    its shapes being the CPU's own. The fields that change nothing a step holds are named once, as
    ignored."""
    path = read(run, "training_args", RUNS, problems, where=where.removesuffix("training_args"))
    if "batch_size" in run:
        problems.append(
            f"{where}: and batch_size: the arguments give the batch; leave batch_size out"
        )
    if path is not None:
        job = training_args.read(path, f"{where} {path}", problems)  # the file named: its keys
    else:
        job = None
    if job is None:
        return None
    seq_len = raw.get("shapes", {}).get("gpu", {}).get("seq_len")
    if job.max_length and isinstance(seq_len, int) and seq_len > job.max_length:
        problems.append(
            f"{where} {path}: max_length = {job.max_length} (an SFTConfig's, padded to its "
            f"multiple), shorter than the suite's seq_len = {seq_len}: TRL truncates every "
            f"sequence to it; set seq_len = {job.max_length} or raise max_length"
        )
        return None
    if (job.ignored or job.sft) and path not in _IGNORED_NAMED:
        _IGNORED_NAMED.add(path)
        kind = (
            "read as TRL's SFTConfig, its defaults where unset (its model_init_kwargs load a model "
            "named by a string, as --hf does; a suite's model loads as its name says); "
            if job.sft
            else ""
        )
        print(
            f"{where} {path}: {kind}ignored, as they change nothing a step holds: "
            f"{', '.join(job.ignored) or 'none'}",
            file=sys.stderr,
        )
    cpu = raw.get("shapes", {}).get("cpu", {}).get("batch_size")
    return TrainerJob(
        job.techniques,
        {"gpu": job.batch_size, "cpu": cpu if isinstance(cpu, int) else job.batch_size},
    )


def _entry_batch(raw: Any, where: str, problems: list[str]) -> dict[str, int] | None:
    """An entry's own batch sizes (``bench advise --max-batch`` writes each plan's largest)."""
    if not (
        isinstance(raw, dict)
        and set(raw) == set(DEVICES)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in raw.values())
    ):
        problems.append(f"{where}: expected {{ gpu = N, cpu = M }}, positive integers, got {raw!r}")
        return None
    return raw


def _matrix(raw: Any, problems: list[str]) -> list[Entry]:
    """Every technique list at every batch size pair and every named length distribution the matrix
    gives."""
    if not isinstance(raw, dict):
        problems.append(f"matrix: expected a table; {TOP['matrix'].doc}")
        return []
    unknown(raw, MATRIX, "matrix.", problems)
    fidelity = read(raw, "fidelity", MATRIX, problems, where="matrix.")
    techs = raw.get("techniques")
    if not isinstance(techs, dict) or not techs:
        problems.append("matrix.techniques: required table of name = [techniques]")
        return []
    if not raw.keys() & {"batch_size", "seq_len", "lengths"}:
        problems.append(
            "matrix: give batch_size = {gpu = [...], cpu = [...]}, seq_len = {gpu = [...], cpu = "
            "[...]}, [matrix.lengths], or several"
        )
        return []
    if "batch_size" in raw:
        sizes = _matrix_sizes(raw["batch_size"], "batch_size", problems)
    else:
        sizes = [None]
    if "seq_len" in raw:
        seqs = _matrix_sizes(raw["seq_len"], "seq_len", problems)
    else:
        seqs = [None]
    if "lengths" in raw:
        lengths = _matrix_lengths(raw["lengths"], problems)
    else:
        lengths = [("", None)]
    if not sizes or not seqs or not lengths:
        return []
    return [
        Entry(
            f"{key}{suffix}",
            t,
            batch=size,
            key=key,
            where=f"matrix.techniques.{key}",
            fidelity=fidelity,
            lengths=dists,
            suffix=suffix,
            seq_len=seq,
        )
        for key, t in techs.items()
        for size in sizes
        for seq in seqs
        for name, dists in lengths
        for suffix in [
            (f"@bs{size['gpu']}" if size else "")
            + (f"@seq{seq['gpu']}" if seq else "")
            + (f"@{name}" if name else "")
        ]
    ]


def _matrix_sizes(sizes: Any, key: str, problems: list[str]) -> list[dict[str, int]]:
    """A matrix dimension of per-device sizes (batch_size, seq_len): the pairs, gpu and cpu, in
    order."""
    lists = isinstance(sizes, dict) and all(isinstance(v, list) for v in sizes.values())
    if not (lists and set(sizes) == set(DEVICES)):
        problems.append(
            f"matrix.{key}: required {{gpu = [...], cpu = [...]}}, lists of equal length"
        )
        return []
    if len(sizes["gpu"]) != len(sizes["cpu"]) or not sizes["gpu"]:
        problems.append(f"matrix.{key}: gpu and cpu lists must be non-empty and of equal length")
        return []
    for dev in DEVICES:
        for j, b in enumerate(sizes[dev]):
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                problems.append(f"matrix.{key}.{dev}[{j}]: must be a positive integer, got {b!r}")
                return []
    return [{"gpu": g, "cpu": c} for g, c in zip(sizes["gpu"], sizes["cpu"])]


def _matrix_lengths(table: Any, problems: list[str]) -> list[tuple[str, dict[str, str]]]:
    """[matrix.lengths]: name = {gpu = "DIST", cpu = "DIST"}; the distributions are checked against
    the shapes in _check_matrix_lengths."""
    if not isinstance(table, dict) or not table:
        problems.append(
            f'matrix.lengths: expected a table of name = {{gpu = "DIST", cpu = "DIST"}}, DIST '
            f"one of {varlen.FORMS}"
        )
        return []
    out = []
    for name, per_device in table.items():
        if not (
            isinstance(per_device, dict) and set(per_device) == set(DEVICES)
        ) or not SUITE_NAME.fullmatch(name):
            problems.append(
                f'matrix.lengths.{name}: expected {{gpu = "DIST", cpu = "DIST"}} under a plain '
                f"name (letters, digits, '.', '_', '-'), DIST one of {varlen.FORMS}"
            )
            continue
        out.append((name, per_device))
    if len(out) == len(table):
        return out
    return []
