"""kvgate configuration: typed frozen settings and their TOML/env loader."""

from config.errors import ConfigError, ConfigIssue
from config.loader import (
    example_names,
    example_path,
    load_settings,
    settings_from_dict,
    settings_to_dict,
    validate_settings,
)
from config.settings import (
    AdmissionMode,
    AdmissionSettings,
    InstanceSettings,
    PDProtocol,
    PoolSettings,
    PredictorSettings,
    PriorityClass,
    ReplicationSettings,
    ReplicationSink,
    Role,
    RoutingSettings,
    ServerSettings,
    Settings,
    SLOSettings,
)

__all__ = [
    "AdmissionMode",
    "AdmissionSettings",
    "ConfigError",
    "ConfigIssue",
    "InstanceSettings",
    "PDProtocol",
    "PoolSettings",
    "PredictorSettings",
    "PriorityClass",
    "ReplicationSettings",
    "ReplicationSink",
    "Role",
    "RoutingSettings",
    "SLOSettings",
    "ServerSettings",
    "Settings",
    "example_names",
    "example_path",
    "load_settings",
    "settings_from_dict",
    "settings_to_dict",
    "validate_settings",
]
