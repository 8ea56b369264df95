"""Which further vLLM flags (a profile's extra_args) may be passed, judged as vLLM's own parser reads them
(kvtune.vllm_parser, from vLLM's committed flag table: vLLM is not imported): a flag a profile field sets,
one kvtune keeps for itself, or one carrying a credential is refused in any spelling."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

from kvtune import vllm_parser
from kvtune.credentials import looks_secret, value_looks_secret

# vLLM settings no profile field sets that kvtune keeps for itself, and why extra_args may not set them.
_SERVES_HTTPS = (
    "serves HTTPS, and kvtune (like the chart's probes) reaches the engine over plain HTTP; remove it"
)
RESERVED_SETTINGS: dict[str, str] = {
    "config": "reads further flags from a file kvtune never checks; remove it and write those flags in the "
    "profile instead",
    "help": "prints vLLM's help and exits instead of serving; remove it",
    "headless": "starts no API server, and kvtune reaches the engine through its API server; remove it",
    "uds": "serves on a Unix socket instead of the host and port kvtune reaches the engine at; remove it",
    "grpc": "serves gRPC on the port instead of the HTTP API kvtune reaches the engine through; remove it",
    "ssl_certfile": _SERVES_HTTPS,
    "ssl_keyfile": _SERVES_HTTPS,
}


class ExtraArgsJudge:
    """Judges extra_args against the flags a profile class sets itself (flag -> field)."""

    def __init__(self, managed_flags: Mapping[str, str]) -> None:
        # By each flag's setting: its destination in vLLM's argument parser (a test checks each resolves
        # so), whatever spelling of the flag extra_args uses.
        self._field_of_setting = {flag.replace("-", "_"): field for flag, field in managed_flags.items()}

    def setting_problem(self, setting: vllm_parser.Setting) -> str | None:
        """Why extra_args may not set this vLLM setting, ending the sentence "'--por' is vLLM's --port, which
        ..."; None when they may.

        A setting carries a credential when it takes a value and its name says so as an environment
        variable's would (api_key, hf_token; not the switch allow_credentials, nor
        long_prefill_token_threshold)."""
        field = self._field_of_setting.get(setting.dest)
        if setting.takes_value and looks_secret(setting.dest):
            fix = (
                f"name the environment variable holding it in the profile field {field!r}"
                if field
                else "list the environment variable vLLM reads it from (e.g. HF_TOKEN) under secret_env"
            )
            return (
                "carries a credential, and extra_args are written to every output; remove it and "
                f"{fix} instead"
            )
        if field:
            return f"the profile sets itself; remove it and set the profile field {field!r} instead"
        return RESERVED_SETTINGS.get(setting.dest)

    def refused_settings(self) -> list[vllm_parser.Setting]:
        """Every setting of vLLM's server (as its flag table lists them) that extra_args may not set."""
        return [setting for setting in vllm_parser.parser().settings() if self.setting_problem(setting)]

    def problem(self, args: list[str]) -> str | None:
        """Why vLLM would not run ARGS as further flags of a profile's engine, judged as vLLM's own parser
        reads them (so every spelling of a flag counts: abbreviations, `=value`, `_` for `-`, `--no-`,
        `--flag.key`); None when it would."""
        for index, word in enumerate(args):
            if any(unicodedata.category(c) == "Cc" for c in word):
                # Each word is written on one line of a script or a YAML comment: a newline starts another.
                return (
                    f"extra_args[{index}]: holds a control character (a newline, a tab); write it on one line"
                )
            if value_looks_secret(word):
                return (
                    f"extra_args[{index}]: looks like a credential (not shown), and extra_args are written "
                    "to every output; pass it in an environment variable listed under secret_env instead"
                )
        if not args:
            return None
        try:
            flags = vllm_parser.parser().flags(args)
        except vllm_parser.ExtraArgError as refused:
            return str(refused)
        for flag in flags:
            written = flag.text.split("=", 1)[0]  # never the value: it may be the credential refused
            problem = self.setting_problem(flag.setting)
            if problem:
                return f"extra_args[{flag.index}]: {written!r} is vLLM's {flag.setting.name}, which {problem}"
            if flag.inline_value and not flag.setting.takes_value:
                return (
                    f"extra_args[{flag.index}]: {written!r} is vLLM's {flag.option_string}, which takes no "
                    f"value; write {flag.option_string} alone"
                )
        return None
