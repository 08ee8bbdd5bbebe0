"""Prototype (not shipped, not used): the settings tree's mechanics on pydantic-settings, for
the measurement in docs/configuration.md ("Why the loader is our own"). Same file layout and KVROUTER_ convention; the domain
rules (policies, replica URLs, tokenizer lengths, ...) would stay as they are."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)


class ConfigError(Exception):
    pass


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Server(_Table):
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    workers: int = Field(1, ge=1)
    load_share_interval_s: float = Field(0.025, ge=0, allow_inf_nan=False)
    max_body_mb: float = Field(64.0, gt=0, allow_inf_nan=False)
    admin_token: str | None = None
    debug_header: bool = False
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 3600.0
    first_byte_timeout_s: float = 600.0
    max_retries: int = Field(2, ge=0)
    retry_after_s: int = 1
    unhealthy_cooldown_s: float = 5.0
    health_interval_s: float = 0.0
    engine_metrics_interval_s: float = Field(1.0, gt=0)
    seed: int = 0
    decisions_kept: int = 256
    pool_per_replica: int = 256
    log_level: str = "info"
    http_engine: str = "fast"
    api_keys: str | None = None
    api_keys_file: str | None = None
    max_concurrent_per_key: int = 0
    max_header_kb: float = 32.0
    max_prompt_tokens: int = 0
    shutdown_timeout_s: float = 30.0
    redis_url: str | None = None
    discover_replicas: bool | None = None
    redis_key_prefix: str = "kvr"
    redis_stream_shards: int = 8
    redis_signing_master: str | None = None
    grpc_port: int | None = None
    grpc_host: str | None = None
    grpc_token: str | None = None
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    grpc_max_message_mb: float = 16.0
    record_path: str | None = None
    record_max_mb: float = 256.0
    record_backups: int = 5
    max_speculative_blocks: int = 1_000_000
    body_memo_mb: float = Field(16.0, ge=0, allow_inf_nan=False)


class Replica(_Table):
    url: str
    model: str
    name: str | None = None
    rack: str | None = None
    region: str | None = None
    dp_ranks: int = Field(1, ge=1)
    zmq: str | None = None
    zmq_replay: str | None = None
    metrics_url: str | None = None


class Busy(_Table):
    max_in_flight: int | None = None
    max_queued_prefill_tokens: int | None = None
    max_kv_usage: float | None = None
    reject_when_all_busy: bool = False


class Images(_Table):
    placeholder: str = "<image>"
    token: str | None = None
    tokens: int = 1
    min_pixels: int | None = None
    max_pixels: int | None = None
    model_id: str | None = None
    hash_algorithm: str = "blake3"


class Slo(_Table):
    ttft_tiers: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


class Model(_Table):
    policy: str = "ours"
    block_size: int = Field(64, gt=0)
    hybrid: bool | None = None
    state_interval_blocks: int = Field(0, ge=0)
    speculative_ttl_s: float = 0.0
    session_ttl_s: float = 600.0
    context_length: int | None = Field(None, gt=0)
    tokenizer: str | None = None
    bpe_file: str | None = None
    pattern: str | None = None
    num_reserved: int | None = None
    chat_template: str | None = None
    cache_mb: float = 256.0
    chars_per_token: float = 4.0
    add_bos_to_completions: bool | None = None
    busy: Busy = Busy()
    images: Images | None = None
    slo: Slo = Slo()
    policy_params: dict[str, Any] = {}

    @field_validator("policy_params", mode="before")
    @classmethod
    def _scalars(cls, value: Any) -> Any:  # env values: TOML scalar syntax
        return _toml_scalars(value)


def _toml_scalars(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _toml_scalars(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            return tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            return value
    return value


class _Env(EnvSettingsSource):
    """KVROUTER_SERVER__<KEY>, KVROUTER_MODELS__<NAME>__<KEY>, KVROUTER_REPLICAS=m=url,...,
    KVROUTER_ADMIN_TOKEN; near misses are errors."""

    def __call__(self) -> dict[str, Any]:
        env = {k.upper(): v for k, v in self.env_vars.items()}
        for var in env:
            head = var.removeprefix("KVROUTER_")
            if var.startswith("KVROUTER_SERVER_") and not var.startswith("KVROUTER_SERVER__"):
                key = head.removeprefix("SERVER_").lower()
                if key in Server.model_fields:
                    raise ConfigError(f"{var}: not read; did you mean KVROUTER_SERVER__{key.upper()}?")
        special = {"kvrouter_replicas", "kvrouter_admin_token"}
        self.env_vars = {k: v for k, v in self.env_vars.items() if k not in special}
        out = super().__call__()
        if "KVROUTER_REPLICAS" in env:
            out["replicas"] = [
                dict(zip(("model", "url"), item.split("=", 1), strict=True))
                for item in env["KVROUTER_REPLICAS"].split(",")
                if item.strip()
            ]
        if "KVROUTER_ADMIN_TOKEN" in env:
            out.setdefault("server", {})["admin_token"] = env["KVROUTER_ADMIN_TOKEN"]
        return out


class Root(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVROUTER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )
    server: Server = Server()
    replicas: list[Replica] = []
    models: dict[str, Model] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _Env(settings_cls))


def _where(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def load(file_data: Mapping[str, Any], environ: Mapping[str, str]) -> Root:
    """File tables, then the environment over them; ConfigError naming the key (and the
    variable, when one set it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        # file data is the lowest source: passed as defaults through init, then env on top
        # (pydantic-settings' deep merge): here, env first then file defaults below it
        return Root(**file_data) if not environ else _merged(file_data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _where(err["loc"])
        var = "KVROUTER_" + "__".join(str(p) for p in err["loc"]).upper()
        origin = f"{var}: " if var in environ else ""
        raise ConfigError(f"{origin}{where}: {err['msg']}, got {err.get('input')!r}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _merged(file_data: Mapping[str, Any]) -> Root:
    env = _Env(Root)()
    return Root.model_validate(_deep(dict(file_data), env)) if env else Root(**file_data)


def _deep(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in extra.items():
        base[k] = _deep(dict(base[k]), v) if isinstance(v, Mapping) and isinstance(base.get(k), Mapping) else v
    return base
