"""runhealth's trainer side: the per-rank hook and what it needs, never the service.

``import collectors`` needs only the standard library and httpx; torch is imported when the
hook attaches. Server code (``monitor``) is never imported here.
"""

from collectors.async_saves import track_async_save
from collectors.checkpoints import build_manifest
from collectors.config import ConfigError, HookConfig, RunHealthConfig
from collectors.hook import RunHealth
from collectors.links import LinkReader
from collectors.nvml import NvmlReader
from collectors.readers import ReadersConfig
from collectors.rollback import Rollback, handle_rollback, load_state_dicts
from collectors.samplers import RecordSink, Sampler
from collectors.stacks import StackDump, dump_stacks
from collectors.tokens import IGNORE_INDEX, supervised_tokens

__all__ = [
    "IGNORE_INDEX",
    "ConfigError",
    "HookConfig",
    "LinkReader",
    "NvmlReader",
    "ReadersConfig",
    "RecordSink",
    "Rollback",
    "RunHealth",
    "RunHealthConfig",
    "Sampler",
    "StackDump",
    "build_manifest",
    "dump_stacks",
    "handle_rollback",
    "load_state_dicts",
    "supervised_tokens",
    "track_async_save",
]
