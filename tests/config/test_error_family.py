"""kvgate's own errors share one base, so an entry point catches ``KvgateError`` (plus OSError)
instead of a tuple that grows with every module; each keeps the builtin base callers relied on."""

from __future__ import annotations

import pytest

from backends.engine_events import KVEventDecodeError
from backends.model_files import ModelFilesError
from backends.profile_file import ProfileFileError
from backends.profiler import ProfileError
from backends.prometheus import MetricsParseError
from config.errors import ConfigError, KvgateError
from config.tenant_keys import KeyFileError
from predictors.calibration import ProfileDataError
from replay.workload.traces import TraceError
from routing.admission import UnknownPriority
from routing.chat_template import ChatTemplateError
from routing.policies.registry import PolicyError, build_policy
from routing.prompt import PromptError

FAMILY = [
    (ConfigError, Exception),
    (PolicyError, ValueError),
    (ChatTemplateError, ValueError),
    (PromptError, ValueError),
    (UnknownPriority, ValueError),
    (ProfileDataError, ValueError),
    (KVEventDecodeError, ValueError),
    (ModelFilesError, ValueError),
    (ProfileFileError, ValueError),
    (MetricsParseError, ValueError),
    (TraceError, ValueError),
    (KeyFileError, ValueError),
    (ProfileError, RuntimeError),
]


@pytest.mark.parametrize(("cls", "builtin"), FAMILY, ids=[c.__name__ for c, _ in FAMILY])
def test_every_error_is_a_kvgate_error_and_keeps_its_builtin_base(cls: type, builtin: type) -> None:
    assert issubclass(cls, KvgateError) and issubclass(cls, builtin)


def test_one_except_clause_catches_them() -> None:
    with pytest.raises(KvgateError, match="not a parameter of round_robin"):
        build_policy("round_robin", {"x": 1})
