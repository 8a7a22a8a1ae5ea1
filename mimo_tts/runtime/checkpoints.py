"""Which checkpoint directories: a path, or an HF id in the local cache (the `tiny` preset is
resolved above this layer, in `mimo_tts.presets`).

Resolution never downloads unless the caller allows it; a missing model is a CheckpointError
that spells out the command that would fetch it. Nothing here loads weights: `locate` and the
memory preflight read only `config.json` and safetensors headers (JSON), so `mimo-tts devices`
never imports torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mimo_tts.errors import CheckpointError

DEFAULT_MODEL = "XiaomiMiMo/MiMo-Audio-7B-Instruct"
DEFAULT_TOKENIZER = "XiaomiMiMo/MiMo-Audio-Tokenizer"
TOKENIZER_PATH_ENV = "MIMO_AUDIO_TOKENIZER_PATH"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelRef:
    """A resolved checkpoint: what was asked, where it came from, and the local directory."""

    name: str
    source: str
    kind: str  # "directory" | "hf-cache" | "download" | "preset"
    path: Path | None
    revision: str | None = None

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "kind": self.kind,
                "path": str(self.path) if self.path else None, "revision": self.revision}


def fetch_hint(repo_id: str) -> str:
    return (f"fetch it with `mimo-tts download` (or `hf download {repo_id}`, "
            f"formerly `huggingface-cli download {repo_id}`)")


def _cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The local snapshot of `repo_id` at `revision` in the Hugging Face cache, or None.

    The cache's documented layout (models--ORG--NAME/refs/REV -> snapshots/HASH), read with
    huggingface_hub's constants only: its download API costs 0.3 s to import, too slow for
    `mimo-tts devices`; `snapshot_download` still handles downloads.
    """
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    try:
        commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if re.fullmatch(r"[0-9a-f]{40}", commit) and snapshot.is_dir() else None


def _from_hf_cache(repo_id: str, source: str, allow_download: bool) -> ModelRef:
    if not allow_download:
        cached = _cached_snapshot(repo_id)
        if cached is None:
            from huggingface_hub import constants

            raise CheckpointError(f"model {repo_id} is not in the local Hugging Face cache "
                                  f"({constants.HF_HUB_CACHE}); {fetch_hint(repo_id)}")
        return ModelRef(repo_id, source, "hf-cache", cached, revision=cached.name)
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id))
    except Exception as exc:  # the hub raises many types (offline, not cached, HTTP)
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"could not download {repo_id} (is this machine online? "
                              f"HF_ENDPOINT / HF_TOKEN may be needed): {reason}") from None
    return ModelRef(repo_id, source, "download", path, revision=path.name)


def resolve(name: str, source: str, role: str, allow_download: bool = False) -> ModelRef:
    """Resolve one checkpoint name (a directory, or an HF repo id) to a local dir."""
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelRef(name, source, "directory", path.resolve(), _snapshot_revision(path))
    if _REPO_ID.match(name) and not name.startswith((".", "/", "~")):
        return _from_hf_cache(name, source, allow_download)
    raise CheckpointError(f"{role} checkpoint directory not found: {name} (from {source})")


def _snapshot_revision(path: Path) -> str | None:
    """The commit hash when `path` is an HF cache snapshot directory."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", resolved.name):
        return resolved.name
    return None


def download(repo_ids: list[str]) -> list[ModelRef]:
    """Fetch checkpoints into the Hugging Face cache (needs network access)."""
    return [_from_hf_cache(repo_id, "download", allow_download=True) for repo_id in repo_ids]


# --- preflight (no weights are read) ------------------------------------------------------------


def locate(name: str, source: str, role: str,
           parse: Callable[[dict], object]) -> tuple[Path | None, str]:
    """Where a checkpoint would be found, without writing or downloading: (path, status);
    `parse` is the config parser of the role's model (a broken config.json is "broken")."""
    try:
        ref = resolve(name, source, role, allow_download=False)
    except CheckpointError as exc:
        return None, f"missing: {exc}"
    from mimo_tts.runtime.safetensors import check_files

    try:  # what a load would refuse before reading a weight: config, headers, sizes, index
        check_files(ref.path, parse)
    except CheckpointError as exc:
        return ref.path, f"broken: {exc}"
    return ref.path, "present"


def checkpoint_dtype(path: Path | None) -> str | None:
    """The `torch_dtype` a checkpoint's config.json declares, or None when there is no
    checkpoint or it does not say. Reads one JSON file."""
    if path is None:
        return None
    try:
        value = json.loads((path / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
