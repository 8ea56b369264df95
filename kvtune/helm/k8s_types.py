"""Kubernetes' own rules for values the chart turns into objects: names, quantities and resource requirements.

A value that becomes an object's name (a Secret, a claim, a RuntimeClass, a volume) must be what the API
server accepts, or the release installs and its pods never start. Each rule is Kubernetes' own
(k8s.io/apimachinery/pkg/util/validation, as of 1.37), stated once here and carried into values.schema.json
as a pattern, so `helm install` refuses the value at its path before anything reaches the cluster.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# RFC 1123 label: volume, container and port names, namespaces. At most 63 characters.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = rf"^{_LABEL}$"
# RFC 1123 subdomain: most objects' names (Secrets, claims, ServiceAccounts, RuntimeClasses). At most 253.
DNS1123_SUBDOMAIN = rf"^{_LABEL}(\.{_LABEL})*$"
# RFC 1035 label: a Service's name (it becomes a DNS label, so it starts with a letter). At most 63.
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# An extended resource's name (a GPU, a MIG profile): a qualified name whose prefix is a subdomain, such as
# nvidia.com/gpu or nvidia.com/mig-3g.40gb; its name part is at most 63 characters.
EXTENDED_RESOURCE = rf"^{_LABEL}(\.{_LABEL})*/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
# A key of a Secret or ConfigMap.
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"

_LABEL_TEXT = "lower-case letters, digits and '-', starting and ending with a letter or digit"
_SUBDOMAIN_TEXT = f"a DNS-1123 subdomain: {_LABEL_TEXT}, in parts joined by '.'; at most 253 characters"


def _optional(pattern: str) -> str:
    """PATTERN, or the empty string (the chart's "not used")."""
    return f"^$|{pattern}"


Dns1123Label = Annotated[str, Field(pattern=DNS1123_LABEL, max_length=63)]
Dns1123Subdomain = Annotated[str, Field(pattern=DNS1123_SUBDOMAIN, max_length=253)]
ConfigKey = Annotated[str, Field(pattern=CONFIG_KEY, max_length=253)]


def subdomain_field(description: str, default: str = "") -> Any:
    """A field naming an object (empty = not used), refused unless Kubernetes would accept the name."""
    return Field(
        default,
        pattern=_optional(DNS1123_SUBDOMAIN),
        max_length=253,
        description=f"{description} ({_SUBDOMAIN_TEXT}.)",
    )


def label_field(description: str, default: str = "") -> Any:
    """A field naming a namespace or another DNS-1123 label (empty = not used)."""
    return Field(
        default,
        pattern=_optional(DNS1123_LABEL),
        max_length=63,
        description=f"{description} (a DNS-1123 label: {_LABEL_TEXT}; at most 63 characters.)",
    )


def service_name_field(description: str, default: str = "") -> Any:
    """A field naming a Service (empty = not used): an RFC 1035 label, so it starts with a letter."""
    return Field(
        default,
        pattern=_optional(DNS1035_LABEL),
        max_length=63,
        description=f"{description} (a Service name: lower-case letters, digits and '-', starting with a "
        "letter and ending with a letter or digit; at most 63 characters.)",
    )


# A quantity as the chart can compare it (templates/_helpers.tpl "kvtune.quantity" reads the same forms):
# a plain decimal with an optional binary (Ki..Ei) or decimal (n, u, m, k..E) suffix. Kubernetes also reads
# signs and exponents (1e3); the chart asks for the plain form, which says the same thing.
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
Quantity = (
    Annotated[int, Field(ge=0)]
    | Annotated[float, Field(ge=0, allow_inf_nan=False)]
    | Annotated[str, Field(pattern=QUANTITY)]
)


class Resources(BaseModel):
    """A container's resources, as Kubernetes' ResourceRequirements (each request at most its limit)."""

    model_config = ConfigDict(extra="forbid")

    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Most the container may use, e.g. {memory: 96Gi}."
    )
    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="What the scheduler reserves, e.g. {cpu: '8', memory: 64Gi}: quantities such as 8Gi, "
        "500m or 2.",
    )
    claims: list[dict[str, Any]] = Field(
        default_factory=list, description="Dynamic resource claims the container uses, by name."
    )
