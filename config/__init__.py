"""models.yaml: its schema, its loader, and resolved deployments. Imports nothing of the project."""

from config.deployment import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_PATH,
    ConfigError,
    Deployment,
    ReplicaConfig,
    deployment_serving,
    load,
    load_deployment,
    resolve,
)
from config.schema import Limits, ModelsFile, QosClass, Slo, Tier

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_PATH",
    "ConfigError",
    "Deployment",
    "Limits",
    "ModelsFile",
    "QosClass",
    "ReplicaConfig",
    "Slo",
    "Tier",
    "deployment_serving",
    "load",
    "load_deployment",
    "resolve",
]
