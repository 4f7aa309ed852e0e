"""The scheduler's pure part: no I/O, no clock, no asyncio (an import-linter contract).

``machine.py`` is the state machine every input goes through (``handle(event, now) -> effects``);
``scheduling.py`` (``SchedulerCore``) runs admitted requests; the rest are its parts. The shell
(``services/scheduler/shell/``) feeds it and carries its effects out.
"""
