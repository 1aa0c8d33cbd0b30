"""Where a model's config.json is: a local file or folder, or a Hugging Face hub repository named as
accelerate and every memory calculator take one, ``ORG/NAME[@REVISION]``.

A repository's config.json is read from huggingface_hub's cache, as transformers reads it: its
folder is ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub (huggingface_hub's
own rule, read when asked so that a test's ``HF_HOME`` holds). Where it is not cached it is
downloaded, config.json alone and never the weights, unless ``HF_HUB_OFFLINE`` is set; a name that
cannot be read says why and the two ways out: run where the hub is reachable (logged in, for a gated
model), or give a local folder holding the config.json.

Nothing here imports the project: the ground floor (bench.spec) asks it where a name's config is.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

CONFIG = "config.json"
# ORG/NAME as the hub spells a repository, with an optional @REVISION (a branch, tag or commit)
REPO = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
TRUE = ("1", "true", "yes", "on")  # huggingface_hub's truthy environment values


class HubError(KeyError):
    """A repository's config.json that cannot be had here: why, and what to do."""

    def __str__(self) -> str:  # a KeyError shows its message quoted otherwise
        return str(self.args[0])


def config_file(where: str) -> Path:
    """The config.json ``where`` names: a file, the config.json of a folder, or a repository's from
    the cache (downloaded where not cached). A name that is neither a path that exists nor a
    repository's is returned as a path, for its reader to say it is missing."""
    path = Path(where)
    if path.is_dir():
        return path / CONFIG
    if path.exists() or not (named := REPO.fullmatch(where)):
        return path
    repo, revision = named["repo"], named["revision"]
    return _cached(repo, revision) or _downloaded(repo, revision)


def cache_folder() -> Path:
    """huggingface_hub's cache of repositories, as it finds it from the environment."""
    if folder := os.environ.get("HF_HUB_CACHE"):
        return Path(folder)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface") / "hub"


def _cached(repo: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, CONFIG, cache_dir=cache_folder(), revision=revision)
    if isinstance(found, str):  # else None, or a marker that the file is known not to exist
        return Path(found)
    return None


def _downloaded(repo: str, revision: str | None) -> Path:
    """The repository's config.json fetched into the cache, or a HubError saying why not."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo + (f"@{revision}" if revision else "")
    local = f"or give a local folder holding its {CONFIG} (hf:PATH, --hf PATH)"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE:
        raise HubError(
            f"{name}'s {CONFIG} is not in huggingface_hub's cache ({cache_folder()}) and "
            f"HF_HUB_OFFLINE is set; run once where the hub is reachable (only {CONFIG} is "
            f"fetched, never the weights), {local}"
        )
    # huggingface_hub retries an unreachable hub for about half a minute, saying so
    print(f"{name}: fetching its {CONFIG} from the hub", file=sys.stderr, flush=True)
    try:
        got = hf_hub_download(repo, CONFIG, revision=revision, cache_dir=cache_folder())
    except GatedRepoError:
        raise HubError(
            f"{name} is gated: accept its licence on huggingface.co and log in (hf auth login), "
            f"{local}"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"the hub has no revision {revision!r} of {repo}") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo}: no such repository on the hub, or a private one: check the name, log in "
            f"(hf auth login), {local}"
        ) from None
    except RemoteEntryNotFoundError:
        raise HubError(f"{name} holds no {CONFIG}; {local}") from None
    except Exception as exc:  # noqa: BLE001  no network, a proxy's refusal, a timeout: the hub is out of reach
        raise HubError(
            f"{name}'s {CONFIG} is not in huggingface_hub's cache ({cache_folder()}) and the "
            f"hub cannot be reached ({type(exc).__name__}); run once where it is (only {CONFIG} "
            f"is fetched, never the weights), {local}"
        ) from None
    return Path(got)
