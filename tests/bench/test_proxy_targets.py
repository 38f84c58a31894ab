from pathlib import Path

from bench.proxy_targets import ALL_TARGETS, KVGATE_TARGETS, kvgate_config
from config.loader import load_settings


def test_kvgate_targets_differ_only_in_prompt_identity(tmp_path: Path) -> None:
    assert set(KVGATE_TARGETS) <= set(ALL_TARGETS)
    urls = ["http://127.0.0.1:18001", "http://127.0.0.1:18002"]
    plain, exact = tmp_path / "plain.toml", tmp_path / "exact.toml"
    plain.write_text(kvgate_config(urls, 18100))
    exact.write_text(kvgate_config(urls, 18101, tmp_path / "model"))
    a, b = load_settings(plain), load_settings(exact)
    assert a.routing.model_dir is None
    assert b.routing.model_dir == str(tmp_path / "model")
    assert [i.url for i in a.instances()] == [i.url for i in b.instances()] == urls
