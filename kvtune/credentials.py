"""What counts as a credential, so that none is printed, logged, written to a file or put on a command line.

Two questions, asked wherever a user hands kvtune a name or a value:
- does an environment variable's NAME say its value is a credential (HF_TOKEN, DB_PASS, GITHUB_PAT)?
- does a VALUE look like a credential (a URL with a password, a token in a well-known format), for example one
  typed where the name of the variable holding it belongs (`--api-key-env sk-live-...`)?
A value judged a credential is never quoted back, not even in the error that refuses it.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_POSIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# A name is a credential's when its last word ends with one of these (HF_TOKEN, HFTOKEN, DB_PASS, PGPASSWORD,
# VLLM_API_KEY, APIKEY, CLIENT_SECRET, GCP_CREDENTIALS) or is PAT (GITHUB_PAT), or when any word is SECRET
# (AWS_SECRET_ACCESS_KEY). The last word, not any word: vLLM's own VLLM_USE_FASTOKENS,
# VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD and VLLM_ENABLE_PREGRAD_PASSES are settings, and HF_TOKEN_PATH is a
# path (a test runs every variable vLLM reads through this rule).
_SECRET_ENDINGS = (
    "TOKEN",
    "PASS",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "KEY",
    "SECRET",
    "CREDENTIAL",
    "CREDENTIALS",
)
_SECRET_LAST_WORDS = frozenset({"PAT"})
_SECRET_ANY_WORDS = frozenset({"SECRET"})

# Token formats issuers publish so that scanners can find leaked ones: Hugging Face, OpenAI-style keys,
# GitHub, GitLab, Slack, AWS access key ids, JSON web tokens, an Authorization header's value.
_TOKEN_FORMATS = re.compile(
    r"hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|glpat-[A-Za-z0-9_-]{16,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*|(?i:bearer|basic)\s+\S{8,}"
)


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name says its value is a credential."""
    words = [word for word in name.upper().split("_") if word]
    if not words:
        return False
    last = words[-1]
    named = last.endswith(_SECRET_ENDINGS) or last in _SECRET_LAST_WORDS
    return named or bool(_SECRET_ANY_WORDS & set(words))


def secret_name_pattern() -> str:
    """`looks_secret` as a regular expression (RE2 and Python alike) searched in a name in upper case: for a
    template that cannot run Python (the chart's check of engine.env)."""
    endings = "|".join(sorted(_SECRET_ENDINGS, key=len, reverse=True))
    last = "|".join(sorted(_SECRET_LAST_WORDS))
    anywhere = "|".join(sorted(_SECRET_ANY_WORDS))
    return f"(?:{endings})_*$|(?:^|_)(?:{last})_*$|(?:^|_)(?:{anywhere})(?:_|$)"


def value_looks_secret(value: str) -> bool:
    """Whether a value is a credential by its form: a URL carrying a password, or a known token format."""
    if _TOKEN_FORMATS.search(value):
        return True
    if "://" in value:
        try:
            return urlsplit(value.strip()).password is not None
        except ValueError:  # an unparseable port: it may still carry one, so it is not shown either
            return "@" in value
    return False


def posix_name_problem(name: str, example: str = "HF_HOME") -> str | None:
    """Why `name` cannot name an environment variable, or None; the text never quotes `name` when it may
    be the credential itself (typed where its variable's name belongs)."""
    if value_looks_secret(name):
        return (
            "looks like a credential itself, not the name of a variable holding one (the value is not "
            f"shown); export it under a name and give that name, e.g. {example}"
        )
    if _POSIX_NAME.fullmatch(name):
        return None
    shown = repr(name) if len(name) <= 40 and not any(c.isspace() for c in name) else "the value given"
    return (
        f"{shown} is not an environment variable name: use letters, digits and '_' and do not start "
        f"with a digit (e.g. {example})"
    )


# Starts of tokens a name's shape would not give away (OpenAI-style and Grafana keys, JSON web tokens): a
# "name" beginning so is taken for the token itself.
_TOKEN_STARTS = ("sk-", "sk_", "glsa_", "glc_", "eyj")
_LONGEST_NAME = 64


def not_a_variable_name(text: str) -> bool:
    """Whether `text`, given as the NAME of a variable holding a credential, cannot be one: not a name of
    at most 64 characters, or shaped like the credential itself. The text is then never quoted back."""
    is_name = bool(_POSIX_NAME.fullmatch(text)) and len(text) <= _LONGEST_NAME
    return not is_name or value_looks_secret(text) or text.lower().startswith(_TOKEN_STARTS)


def name_may_be_shown(name: str) -> bool:
    """Whether a variable's name may be printed: variables are named in capitals (VLLM_API_KEY), and a name
    of another shape may be a token typed in its place."""
    return not not_a_variable_name(name) and name.isupper()
