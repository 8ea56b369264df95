"""`make test` runs engine tests on one pytest-xdist worker (`--dist loadgroup`, tests/conftest.py): two
workers each holding their own engines run this 24 GiB machine out of memory."""

from __future__ import annotations

import pytest


@pytest.mark.engine
def test_engine_tests_are_grouped_on_one_worker(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        return  # a plain `pytest` run has one process: nothing to group
    # pytest-xdist marks a grouped test by suffixing its node id with the group's name.
    assert request.node.nodeid.endswith("@engines"), request.node.nodeid
