"""The studies resume through the runs' own mechanism: ``reuse=True`` of the API loads a folder when
:func:`ctuq.run.holds_result` says it holds the finished result of the call's config. Checked on a written
``config.yaml`` (no run): the same config, another one, a missing result file, a file written before a key existed
(that key's default is what the run did) and a key this version no longer has."""

import yaml

from ctuq.config import load_config
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.runner import write_config
from ctuq.run import holds_result


def test_holds_result_compares_the_written_config(tmp_path):
    cfg = load_config("tiny", ["dip.iterations=7"])
    write_config(cfg, tmp_path)
    (tmp_path / rf.METRICS_NAME).write_text("{}")
    assert holds_result(tmp_path, cfg, rf.METRICS_NAME)
    assert holds_result(tmp_path, load_config(tmp_path / rf.CONFIG_NAME), rf.METRICS_NAME)  # read back: equal
    assert not holds_result(tmp_path, load_config("tiny", ["dip.iterations=8"]), rf.METRICS_NAME)
    assert not holds_result(tmp_path, cfg, rf.METRICS_NAME, rf.STD_NAME)  # a result file missing: not finished
    assert not holds_result(tmp_path / "nothing", cfg, rf.METRICS_NAME)

    def rewrite(edit) -> None:
        written = yaml.safe_load((tmp_path / rf.CONFIG_NAME).read_text())
        edit(written)
        (tmp_path / rf.CONFIG_NAME).write_text(yaml.safe_dump(written, sort_keys=False))

    rewrite(lambda d: d["dip"].pop("enabled"))  # written before dip.enabled existed: its default, what the run did
    assert holds_result(tmp_path, cfg, rf.METRICS_NAME)
    assert not holds_result(tmp_path, load_config("tiny", ["dip.iterations=7", "dip.enabled=false"]), rf.METRICS_NAME)
    rewrite(lambda d: d["dip"].update(no_longer_a_key=1))  # a key this version does not know: not its result
    assert not holds_result(tmp_path, cfg, rf.METRICS_NAME)
