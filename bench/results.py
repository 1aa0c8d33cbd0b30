"""Result records: one flat JSON file per run under results/<suite>/<device>/, written atomically,
and loaded back into a pandas DataFrame."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from bench.errors import BadInput
from bench.record import (
    KEY,
    STATUSES,
    Accuracy,
    FidelityResult,
    Identity,
    Provenance,
    Record,
    label,
    migrate,
    problems,
)

if TYPE_CHECKING:
    from bench.spec import RunSpec

REQUIRED = {KEY.suite, KEY.run, KEY.device, KEY.status}  # what every reader of a record relies on


def slug(text: str) -> str:
    """A file-system-safe name in any script: 'NVIDIA H100 80GB HBM3' → 'nvidia-h100-80gb-hbm3',
    'Базовый' → 'базовый'."""
    return re.sub(r"[^\w.@+-]+", "-", text.lower()).strip("-.")


def run_stem(run: str) -> str:
    """A run's file name: its slug where that is the name itself, else the slug and a digest of the
    name, so that no two names ('amp bf16', 'AMP-bf16'; '🚀', '🔥') share a file and one record
    never replaces another."""
    stem = slug(run)
    if stem == run:
        return stem
    return f"{stem}~{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def suite_folder(results: Path, suite: str, device: str) -> Path:
    return results / suite / slug(device)


def record_path(results: Path, suite: str, device: str, run: str) -> Path:
    return suite_folder(results, suite, device) / f"{run_stem(run)}.json"


def write_between(path: Path, begin: str, end: str, body: str, missing: str = "") -> None:
    """A generated part of a page, rewritten between its two marker lines; the prose around it stays
    as written. A page without the markers gets the part at its end (``missing``: the text of a page
    not there).
    """
    if path.exists():
        text = path.read_text(encoding="utf-8")
    else:
        text = missing
    head, _, rest = text.partition(begin)
    write_atomic(path, head + begin + "\n" + body + "\n" + end + rest.partition(end)[2])


def write_atomic(path: Path, record: dict[str, Any] | str) -> None:
    """Write to a temporary file beside the target, then rename: a reader never sees half a record.
    Readable by all, as every other file of a checkout (mkstemp's own mode, 0600, would be committed
    with it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(
            fd, "w", encoding="utf-8"
        ) as f:  # whatever the locale (LC_ALL=C emptied report.md)
            f.write(
                record
                if isinstance(record, str)
                else json.dumps(record, indent=1, sort_keys=True, default=str)
            )
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def store(path: Path, record: dict[str, Any]) -> bool:
    """Write the record; where that fails (a full disk, a folder made read-only meanwhile), keep the
    measurement in a file of the temporary folder and name it on stderr rather than lose it. Returns
    whether it is at ``path``: the sweep's exit status says so."""
    try:
        write_atomic(path, record)
        return True
    except OSError as exc:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        kept = (
            Path(tempfile.gettempdir())
            / f"bench-unsaved-{slug(record[KEY.suite])}-{path.stem}-{stamp}.json"
        )
        kept.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        print(
            f"error: could not write {path} ({exc.strerror or exc}); the measurement is kept in "
            f"{kept}: copy it there once the folder can be written",
            file=sys.stderr,
        )
        return False


def save_beside(path: Path, suffix: str, text: str) -> str:
    """A text file beside a record (``<run>.memory.txt``); returns its name, for the record to point
    at."""
    side = path.with_suffix(suffix)
    try:
        write_atomic(side, text)
    except OSError as exc:
        print(f"warning: could not write {side}: {exc}", file=sys.stderr)
    return side.name


# What a device's folder holds that came from measuring: the records and the files saved beside
# them.
PACKED = ("*.json", "*.memory.txt", "*.history.pickle.gz", "*.snapshot.pickle", "fit/*.json")


def pack(archive: Path, results: Path, suites: list[str], device: str) -> None:
    """The suites' records on this device, with what is saved beside each (memory summary, the
    allocator's history, a --snapshot) and the fit probes, as one .tar.gz, replaced atomically: a
    machine that hands back one folder, and may be cut off at any moment, hands back everything
    measured so far."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f".{archive.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for suite in suites:
            folder = suite_folder(results, suite, device)
            for path in sorted(path for pattern in PACKED for path in folder.glob(pattern)):
                tar.add(path, arcname=path.relative_to(results.parent))
    os.replace(tmp, archive)


def check_writable(results: Path, suites: list[str], device: str | None) -> None:
    """Before the first run: each suite's record folder (of ``device``; None: not known before the
    runs, the suite's) can be made and written, so that a measurement is never taken only to be
    lost. Raises BadInput naming the folder."""
    for suite in suites:
        writable(
            suite_folder(results, suite, device) if device else results / suite,
            "records",
            "--results FOLDER",
        )


def refuse_dangling(folder: Path, flag: str) -> None:
    """A symbolic link on the folder's path whose target is gone: BadInput naming both (mkdir said
    only "File exists", of a folder that does not)."""
    for p in (folder, *folder.parents):
        if p.is_symlink() and not p.exists():
            raise BadInput(
                f"{p} is a symbolic link to {os.readlink(p)}, which does not exist; make that "
                f"folder, remove the link, or pass {flag}"
            )


def writable(folder: Path, what: str, flag: str) -> None:
    """Before any work: ``folder`` can be made and written; else BadInput naming it, what would go
    there, and the flag that puts it elsewhere (a search or a sweep's output was found unwritable
    only once it was done). Folders it made to find out are removed again: nothing is left behind by
    a command that then writes nothing."""
    refuse_dangling(folder, flag)
    if not folder.exists():
        made = next((p for p in (folder, *folder.parents) if p.parent.exists()), folder)
    else:
        made = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise BadInput(
            f"cannot write {what} in {folder}: {exc.strerror or exc}; make it writable or pass "
            f"{flag}"
        ) from None
    finally:
        if made is not None and made.is_dir():
            for p in (
                folder,
                *folder.parents,
            ):
                # the empty folders it made, up to the first that was there
                if p.is_dir() and not any(p.iterdir()):
                    p.rmdir()
                if p == made:
                    break


def base_record(spec: RunSpec, device: str, device_type: str, key: str, revision: str) -> Record:
    """What a record says of the run before it is measured: its identity, shapes and
    specification."""
    shapes = spec.shapes(device_type)
    identity = Identity(
        suite=spec.suite,
        run=spec.name,
        model=spec.model_on(device_type),
        baseline=spec.baseline,
        techniques=[t.label for t in spec.techniques],
        device=device,
        device_type=device_type,
        batch_size=shapes.batch_size,
        image_size=shapes.image_size,
        seq_len=shapes.seq_len,
        prompt_len=shapes.prompt_len,
        new_tokens=shapes.new_tokens,
        seed=spec.seed,
        warmup_steps=shapes.warmup_steps,
        measure_steps=shapes.measure_steps,
        nproc=spec.nproc,
        run_key=key,
        spec=spec.to_dict(),
    )
    return Record(identity=identity, provenance=Provenance(git_revision=revision))


def read(path: Path, warn: bool = True) -> dict[str, Any] | None:
    """The stored record, or None. One that cannot be parsed (a hand edit, a git merge conflict) is
    named on stderr: silently leaving a measured run out of a report would hide it."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not (
            isinstance(record, dict)
            and record.keys() >= REQUIRED
            and record[KEY.status] in STATUSES
        ):
            raise ValueError(
                f"not a record: expected an object with {', '.join(sorted(REQUIRED))} and a status "
                f"among {', '.join(STATUSES)}"
            )
        if wrong := problems(migrate(record)):
            raise ValueError(f"a field of the wrong type: {'; '.join(wrong)}")
        return record
    except FileNotFoundError:
        return None
    except (
        OSError,
        ValueError,
    ) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        if warn:
            print(f"warning: {path}: unreadable record, treated as absent ({exc})", file=sys.stderr)
        return None


def set_aside_if_unreadable(path: Path) -> None:
    """Before a record is written over: one that cannot be parsed (a merge conflict may hold two
    measurements) moves to <run>.json.unreadable (.unreadable-2, … beside earlier ones) rather than
    being lost."""
    if path.exists() and read(path, warn=False) is None:  # named already, when the sweep read it
        asides = (
            path.with_name(path.name + ".unreadable" + (f"-{n}" if n > 1 else ""))
            for n in itertools.count(1)
        )
        path.replace(next(a for a in asides if not a.exists()))


LOCK = ".sweep.lock"
# beside a suite's device folders: the whole suite predicted at GPU shapes
PREDICTED = "predicted-gpu.csv"
# beside them too, per card: a generation's longest contexts (predict --card)
CONTEXTS = "longest-{card}.csv"
# and a training suite's longest-sequence searches, each length predicted (predict --card --longest)
CURVES = "lengths-{card}.csv"
# Beside them too: figures measured elsewhere and published, a row each: the suite's run, the card
# (a name of bench.predict.cards), nvidia-smi's MiB for the process, and where it was published
# (bench.predict.held).
PUBLISHED = "published.csv"


def read_contexts(suite_dir: Path) -> dict[str, dict[str, int | None]]:
    """Every card's longest contexts saved beside a suite's records: card name → run → tokens."""
    import pandas as pd

    out: dict[str, dict[str, int | None]] = {}
    for path in sorted(suite_dir.glob(CONTEXTS.format(card="*"))):
        rows = pd.read_csv(path)
        for card, part in rows.groupby("card"):
            out[str(card)] = {r: int(n) for r, n in zip(part[KEY.run], part["longest_context"])}
    return out


@contextmanager
def sweeping(folders: list[Path]) -> Iterator[None]:
    """Held by one sweep at a time per record folder: a second sweep of the same suite and device
    would measure every run again beside the first and overwrite its records, so it is refused,
    naming the first. The lock is the operating system's (flock): a sweep that dies releases it."""
    held = []
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            handle = open(folder / LOCK, "a+")  # noqa: SIM115  held open for the sweep's length
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                who = handle.read().strip() or "another process"
                handle.close()
                raise BadInput(
                    f"{folder} is being measured by another sweep ({who}); wait for it to finish, "
                    "or give this one --results elsewhere"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(
                f"pid {os.getpid()}, since {datetime.now(UTC).isoformat(timespec='seconds')}\n"
            )
            handle.flush()
            held.append(handle)
        yield
    finally:
        for handle in held:
            handle.close()


SUPERSEDED = "superseded"  # beside a device's records: those a later measurement replaced


def keep_superseded(path: Path) -> Path | None:
    """Before a record is written over by a new measurement: the stored one moves to
    superseded/<run>.<stored_at>.json beside it (reports read only the folder's own records), so
    that nothing measured is lost to an edited suite, --force or a changed key."""
    if path.exists():
        old = read(path, warn=False)
    else:
        old = None
    if old is None:
        return None
    stamp = str(old.get(KEY.stored_at) or old.get(KEY.finished_at) or "unstamped").replace(":", "")
    kept = path.parent / SUPERSEDED / f"{path.stem}.{stamp}.json"
    try:
        kept.parent.mkdir(exist_ok=True)
        path.replace(kept)
    except OSError as exc:  # the new record is stored all the same (or kept aside by store)
        print(
            f"warning: could not keep {path} in {kept.parent}/: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return None
    return kept


def load_records(suite_dir: Path) -> list[dict[str, Any]]:
    """Every record of a suite, all devices."""
    return [r for p in sorted(suite_dir.glob("*/*.json")) if (r := read(p)) is not None]


def to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per run, records of any age in today's form (bench.record.migrate), with what is
    derived from several of them: the accuracy delta against the baseline run on the same device.
    ``techniques`` is the label tables show, ``technique`` the first technique's name (what colours
    it); the technique proofs become ``proof.<technique>.<key>`` columns, the versions of the
    packages the run imported ``package.<name>``."""
    flat = [migrate(r) for r in records]
    baselines = {
        (r.get(KEY.suite), r[KEY.device]): r for r in flat if r[KEY.run] == r.get(KEY.baseline)
    }
    rows = []
    for r in flat:
        row = {
            k: v
            for k, v in r.items()
            if k not in (KEY.proof, KEY.spec, KEY.packages, KEY.techniques)
        }
        row |= {
            KEY.techniques: label(r.get(KEY.techniques) or []),
            "technique": _first_technique(r),
        }
        base = baselines.get((r.get(KEY.suite), r[KEY.device]))
        if accuracy := Accuracy.of(_fidelity(r), base and _fidelity(base)):
            row |= accuracy.flat()
        row |= {f"proof.{k}": v for k, v in (r.get(KEY.proof) or {}).items()}
        row |= {f"package.{k}": v for k, v in (r.get(KEY.packages) or {}).items()}
        rows.append(row)
    return pd.DataFrame(rows)


def _fidelity(record: dict[str, Any]) -> FidelityResult:
    return Record.from_flat(record).fidelity


def _first_technique(record: dict[str, Any]) -> str:
    """The name of the run's first technique ("" for none), from its specification where it has
    one."""
    if techniques := (record.get(KEY.spec) or {}).get(KEY.techniques):
        return techniques[0]["name"]
    return (record.get(KEY.techniques) or [""])[0].split("(")[0]
