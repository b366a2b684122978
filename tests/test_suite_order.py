"""conftest.py's LONGEST_FIRST: the files it starts first exist and come first."""

from pathlib import Path

import conftest

HERE = Path(__file__).resolve().parent


def test_every_file_started_first_exists():
    assert [name for name in conftest.LONGEST_FIRST if not (HERE / name).is_file()] == []


def test_the_listed_files_come_first_and_the_rest_keep_their_order():
    class Item:
        def __init__(self, name: str) -> None:
            self.path = HERE / name

    names = ["bench/test_cli.py", conftest.LONGEST_FIRST[3], "test_errors.py", conftest.LONGEST_FIRST[0],
             "bench/test_cli.py", "router/test_wire.py"]
    items = [Item(n) for n in names]
    conftest.pytest_collection_modifyitems(items)
    assert [i.path for i in items] == [HERE / n for n in (
        conftest.LONGEST_FIRST[0], conftest.LONGEST_FIRST[3], "bench/test_cli.py", "test_errors.py",
        "bench/test_cli.py", "router/test_wire.py")]
