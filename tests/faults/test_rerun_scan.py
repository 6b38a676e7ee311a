"""fresh_logdir in a directory full of other programs' event files (a trainer's own TensorBoard
logs, many restarts): deciding that none of them is a probe run must not parse them event by event
(TensorBoard's reader checks CRCs in Python: about 0.3 ms an event, 19 s for 50 files of 2000
scalars measured on the shared machine)."""

from __future__ import annotations

from probe.ci.runs import _holds_probe_run, fresh_logdir


def test_event_files_without_a_probe_tag_are_not_parsed(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing import event_file_loader
    from torch.utils.tensorboard import SummaryWriter

    for j in range(3):
        with SummaryWriter(str(tmp_path), filename_suffix=f".{j}") as w:
            for i in range(50):
                w.add_scalar("loss", float(i), i)
    parsed = []
    original = event_file_loader.EventFileLoader.Load

    def load(self):
        parsed.append(self)
        return original(self)

    monkeypatch.setattr(event_file_loader.EventFileLoader, "Load", load)
    assert fresh_logdir(str(tmp_path)) == str(tmp_path)
    assert parsed == []
    with SummaryWriter(str(tmp_path), filename_suffix=".probe") as w:  # a killed probe run: its scalars only
        w.add_scalar("probe.entropy@actual/layers.0", 0.5, 0)
    assert _holds_probe_run(str(tmp_path)) and len(parsed) == 1  # (fresh_logdir: the path is claimed now)
