"""The peer check's own parts (``tests/lightning_peer/peer_check.py``; the check itself needs Lightning's repository
and runs with ``make test-lightning``): the swap, the choice of tag, the reading of junit reports."""

from __future__ import annotations

import textwrap

import pytest

from tests.lightning_peer.peer_check import choose_tag, outcomes, select, swap_source

_LIGHTNING_TEST = textwrap.dedent(
    '''
    """A test module."""
    from __future__ import annotations

    import pytest
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy


    def test_it():
        Trainer(strategy="ddp", devices=2)
        Trainer(strategy = 'ddp_spawn')
        Trainer(strategy="ddp_find_unused_parameters_true")
        Trainer(strategy="fsdp")
        Trainer(strategy="fsdp_cpu_offload")
        with pytest.raises(Exception, match=r"strategy='ddp_notebook'\\)`"):
            Trainer(strategy=DDPStrategy(find_unused_parameters=True))
        assert isinstance(trainer.strategy, DDPStrategy)
        _DDPStrategy(x)
    '''
)


def test_the_swap_replaces_each_counterpart_and_nothing_else():
    swapped, count = swap_source(_LIGHTNING_TEST)
    assert count == 5
    assert 'strategy="mgpu_ddp", devices=2' in swapped
    assert "strategy = 'mgpu_ddp_spawn'" in swapped
    assert 'strategy="ddp_find_unused_parameters_true"' in swapped  # no counterpart: left as it is
    assert 'strategy="mgpu_zero3"' in swapped and 'strategy="fsdp_cpu_offload"' in swapped
    assert "strategy='mgpu_ddp_notebook'" in swapped  # in the expected message too
    assert "strategy=MGPUDDPStrategy(find_unused_parameters=True)" in swapped
    assert "isinstance(trainer.strategy, DDPStrategy)" in swapped  # class checks keep Lightning's class
    assert "_DDPStrategy(x)" in swapped
    lines = swapped.splitlines()
    imported = lines.index("from lightning_mgpu.lightning import MGPUDDPStrategy  # peer check: the swap")
    assert lines[imported + 1] == "import pytest"  # after the docstring and the __future__ import
    compile(swapped, "swapped.py", "exec")


def test_a_file_without_the_class_gets_no_import():
    swapped, count = swap_source('Trainer(strategy="ddp_fork")\n')
    assert (swapped, count) == ('Trainer(strategy="mgpu_ddp_fork")\n', 1)


@pytest.mark.parametrize(
    ("version", "tag"),
    [("2.6.5", "2.6.5"), ("2.6.6", "2.6.5"), ("2.6.6rc1", "2.6.5"), ("2.6.0", "2.6.0"), ("3.0.0", "2.6.5")],
)
def test_the_tag_is_the_installed_release_else_the_nearest_earlier(version, tag):
    assert choose_tag(["2.6.0", "2.6.5", "2.5.6", "nightly", "2.6.10rc"], version) == tag


def test_no_earlier_release_is_an_error():
    with pytest.raises(SystemExit, match="no release tag"):
        choose_tag(["2.6.5"], "2.5.0")


def test_outcomes_are_read_per_test_with_a_teardown_error_kept(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        """<testsuites><testsuite>
        <testcase classname="t.m" name="ok"/>
        <testcase classname="t.m" name="bad"><failure message="x"/></testcase>
        <testcase classname="t.m" name="skip"><skipped message="no CUDA"/></testcase>
        <testcase classname="t.m" name="leak"/>
        <testcase classname="t.m" name="leak"><error message="zombie thread"/></testcase>
        </testsuite></testsuites>"""
    )
    assert outcomes(report) == {
        "t.m::ok": "passed",
        "t.m::bad": "failed",
        "t.m::skip": "skipped",
        "t.m::leak": "error",
    }


def test_selection_keeps_files_naming_a_ddp_or_fsdp_strategy_in_the_folders(tmp_path):
    for rel, text in {
        "loops/test_a.py": 'Trainer(strategy="ddp")',
        "loops/test_b.py": "DDPStrategy()",
        "loops/test_c.py": 'Trainer(strategy="auto")',
        "trainer/connectors/test_d.py": '"fsdp"',
        "models/test_e.py": 'Trainer(strategy="ddp")',
        "loops/helper.py": 'Trainer(strategy="ddp")',
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert select(tmp_path, ("loops", "trainer")) == [
        "loops/test_a.py",
        "loops/test_b.py",
        "trainer/connectors/test_d.py",
    ]
    assert "models/test_e.py" in select(tmp_path, None)
