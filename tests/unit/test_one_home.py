"""One home for every Redis key and NATS subject: they are built in ``libs/protocol/keys.py`` and
``libs/protocol/subjects.py`` only. A formatted string elsewhere in the product that puts a
namespace in front of ``:`` (a Redis key) or ``.`` (a subject) is one built twice, and fails here
with where it is."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOMES = {REPO / "libs/protocol/keys.py", REPO / "libs/protocol/subjects.py"}
FSTRING = re.compile(r"""\bf(["'])(.*?)(?<!\\)\1""")
# ``{ns}:``, ``{self.ns}:``, ``{namespace}.``, ``{common.namespace}:`` ... at a key's or subject's start
NAMESPACED = re.compile(r"^\{[\w.\[\]]*\b(ns|namespace)\b[\w.\[\]]*\}[:.]\w")


def built_outside_home() -> list[str]:
    found = []
    for path in sorted((*REPO.glob("libs/**/*.py"), *REPO.glob("services/**/*.py"))):
        if path in HOMES:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in FSTRING.finditer(line):
                if NAMESPACED.match(m.group(2)):
                    found.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    return found


def test_every_redis_key_and_subject_is_built_in_its_one_module():
    assert built_outside_home() == []


def test_the_check_finds_a_key_built_elsewhere(tmp_path):
    line = 'return f"{self.ns}:gw:res:{request_id}"'
    assert [m.group(2) for m in FSTRING.finditer(line) if NAMESPACED.match(m.group(2))]
    assert not [
        m.group(2)
        for m in FSTRING.finditer('f"t2i-{namespace}-{executor_id}"')
        if NAMESPACED.match(m.group(2))
    ]
