"""Engine profiles: one typed, validated model per vLLM engine, and what it renders (argv, env, serve YAML).

A profile is the single source of each engine setting: the controller's argv, the `vllm serve` YAML and
the Helm chart's values (kvtune.helm.values) are all rendered from it, and each field declares its vLLM
flag, chart key and sweep-knob status once, beside its type (kvtune.profile.fields).

- model: the fields and their validation; fields: the facts each field carries and what is derived from
  them; rendering: argv, serve YAML, sh script, env; credentials: the API key and secrets at launch;
  capacity: the KV pool by arithmetic; host: the profile on the host that runs it; extra_args: further
  vLLM flags judged as vLLM's own parser reads them.
"""

from kvtune.platform import is_loopback
from kvtune.profile.credentials import API_KEY_FILE_BYTES
from kvtune.profile.extra_args import RESERVED_SETTINGS, ExtraArgsJudge
from kvtune.profile.fields import FieldFacts, chart_fields, chart_omissions, facts_of, knobs
from kvtune.profile.fields import managed_env as _managed_env
from kvtune.profile.fields import managed_flags as _managed_flags
from kvtune.profile.model import LONGEST_WAIT_S, EngineProfile, WarmupPrefix, load_profile
from kvtune.profile.rendering import API_SERVER_MODULE, VLLM_API_KEY_ENV

# Every flag the profile renders (or passes another way), and the field that sets it: the same flag in
# extra_args would make kvtune poll one port or describe one config while vLLM runs another.
MANAGED_FLAGS: dict[str, str] = _managed_flags(EngineProfile)
# Every environment variable a field renders, and that field: the same name in env (or secret_env) would
# make the profile and the sweep report describe one binding while vLLM ran another.
MANAGED_ENV: dict[str, str] = _managed_env(EngineProfile)

_EXTRA_ARGS = ExtraArgsJudge(MANAGED_FLAGS)
setting_problem = _EXTRA_ARGS.setting_problem
refused_settings = _EXTRA_ARGS.refused_settings
extra_args_problem = _EXTRA_ARGS.problem

__all__ = [
    "API_KEY_FILE_BYTES",
    "API_SERVER_MODULE",
    "LONGEST_WAIT_S",
    "MANAGED_ENV",
    "MANAGED_FLAGS",
    "RESERVED_SETTINGS",
    "VLLM_API_KEY_ENV",
    "EngineProfile",
    "ExtraArgsJudge",
    "FieldFacts",
    "WarmupPrefix",
    "chart_fields",
    "chart_omissions",
    "extra_args_problem",
    "facts_of",
    "is_loopback",
    "knobs",
    "load_profile",
    "refused_settings",
    "setting_problem",
]
