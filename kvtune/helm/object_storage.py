"""How the engine pod gets credentials for each object store vLLM's Run:ai streamer reads weights from.

Each URL scheme has its own: S3 (and S3-compatible stores) reads the AWS SDK's variables, Google Cloud Storage
a service account's key file named by GOOGLE_APPLICATION_CREDENTIALS (runai-model-streamer's usage guide,
"Streaming from S3" and "Streaming from Google cloud storage"). The chart's templates read this table
(generated into templates/_generated.tpl), so a gs:// model never gets AWS keys, and the schema's
description of modelSource.objectStorage is written from it too.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a store's key file (a key of the credentials Secret) is mounted in the engine container.
CREDENTIALS_MOUNT = "/etc/kvtune/object-storage"


@dataclass(frozen=True)
class StoreCredentials:
    """What a Secret for one URL scheme holds and how the engine container reads it."""

    store: str
    # Keys of the Secret, each set as the environment variable of the same name.
    env_keys: tuple[str, ...] = ()
    # A key of the Secret mounted as a file, and the variable naming its path.
    file_key: str | None = None
    file_env: str | None = None
    # The variable modelSource.objectStorage.endpointUrl sets; None: the store takes no endpoint.
    endpoint_env: str | None = None

    def secret_text(self) -> str:
        keys = [*self.env_keys, *([self.file_key] if self.file_key else [])]
        held = " and ".join(keys)
        return f"keys {held}" if len(keys) > 1 else f"key {held}"


STORES: dict[str, StoreCredentials] = {
    "s3": StoreCredentials(
        store="S3 or an S3-compatible store",
        env_keys=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
        endpoint_env="AWS_ENDPOINT_URL",
    ),
    "gs": StoreCredentials(
        store="Google Cloud Storage",
        file_key="credentials.json",
        file_env="GOOGLE_APPLICATION_CREDENTIALS",
    ),
}


def credentials_description() -> str:
    """modelSource.objectStorage.credentialsSecret's description, one sentence per scheme."""
    per_scheme = "; ".join(
        f"{scheme}:// ({store.store}): {store.secret_text()}"
        + (f" (mounted as a file, {store.file_env} names it)" if store.file_env else "")
        for scheme, store in STORES.items()
    )
    return (
        f"A Secret with the store's credentials, by the model URL's scheme: {per_scheme}. Empty = the pod's "
        "own identity (e.g. a cloud workload identity through serviceAccountName)."
    )


def endpoint_description() -> str:
    takes = [f"{scheme}:// ({store.endpoint_env})" for scheme, store in STORES.items() if store.endpoint_env]
    return f"An S3-compatible store's address, for {', '.join(takes)} only; empty = the provider's own."


def template_table() -> dict[str, dict[str, object]]:
    """The table as the chart's templates read it."""
    return {
        scheme: {
            "store": store.store,
            "envKeys": list(store.env_keys),
            "fileKey": store.file_key,
            "fileEnv": store.file_env,
            "endpointEnv": store.endpoint_env,
            "mountPath": CREDENTIALS_MOUNT if store.file_key else None,
            "secret": store.secret_text(),
        }
        for scheme, store in STORES.items()
    }
