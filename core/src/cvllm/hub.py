"""Turning ``org/name`` (a Hugging Face repo id) into a local path, through the hub's cache.

Nothing is downloaded unless the caller asks (``download=True``, cvserve's ``--download``): a
server that starts by silently pulling gigabytes is a surprise, and tests run offline.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a model directory needs: config, weights, tokenizer and chat template. Leaves out
# duplicate PyTorch/TF/GGUF weights that many repos carry next to the safetensors.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
# an older repo's PyTorch weights, fetched only when it has no safetensors (a repo often has both: never twice)
BIN_PATTERNS = ["pytorch_model*.bin"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(RuntimeError):
    """A repo id could not be resolved to local files; the message says what to do."""


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def _cache_dir() -> str | None:
    # huggingface_hub reads HF_HUB_CACHE once, at import; read it per call so a changed
    # environment (tests, a wrapper script) is honoured.
    return os.environ.get("HF_HUB_CACHE") or None


def resolve(repo_id: str, filename: str | None = None, *, download: bool = False,
            revision: str | None = None) -> Path:
    """The local path of ``repo_id`` (a snapshot directory), or of ``filename`` inside it."""
    if not looks_like_repo_id(repo_id):
        raise HubError(f"'{repo_id}' is neither an existing local path nor a Hugging Face repo id (org/name)")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id}/{filename}" if filename else repo_id
    try:
        if filename:
            path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=_cache_dir(),
                                   local_files_only=not download)
        else:
            path = snapshot_download(repo_id, revision=revision, cache_dir=_cache_dir(),
                                     allow_patterns=SNAPSHOT_PATTERNS, local_files_only=not download)
            if download and not _has_weights(Path(path)):
                path = snapshot_download(repo_id, revision=revision, cache_dir=_cache_dir(),
                                         allow_patterns=BIN_PATTERNS)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if hasattr(exc, "snapshot_path"):  # IncompleteSnapshotError (huggingface_hub >= 1.x): an interrupted download
            hint = "pass --download to complete it" if not download else "the hub could not be reached to complete it"
            raise HubError(f"the cached copy of '{repo_id}' is incomplete: {hint}") from None
        if not download:
            raise HubError(f"'{what}' is not in the local Hugging Face cache; pass --download to fetch it") from None
        raise HubError(f"could not download '{what}' (is the network reachable, HF_HUB_OFFLINE unset?): "
                       f"{exc}") from None
    except GatedRepoError:
        raise HubError(f"'{repo_id}' is gated: accept its terms on the hub and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise HubError(f"no Hugging Face repo '{repo_id}' (or it is private: log in with hf auth login)") from None
    except RevisionNotFoundError:
        raise HubError(f"'{repo_id}' has no revision '{revision}'") from None
    except EntryNotFoundError:
        raise HubError(f"'{repo_id}' has no file '{filename}'") from None
    except HFValidationError as exc:
        raise HubError(f"'{repo_id}' is not a valid repo id: {exc}") from None
    path = Path(path)
    if not filename and not _has_weights(path):
        # A snapshot can exist with only config.json in it (another tool fetched just that).
        hint = "pass --download to fetch the weights" if not download else \
            "the repo has no safetensors or pytorch_model*.bin weights; name a weight file with --f (e.g. a .gguf)"
        raise HubError(f"the cached copy of '{repo_id}' has no *.safetensors weights: {hint}")
    return path


def _has_weights(snapshot: Path) -> bool:
    return any(snapshot.glob("*.safetensors")) or any(snapshot.glob("pytorch_model*.bin"))
