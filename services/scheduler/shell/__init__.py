"""The scheduler's I/O: one inbox and one loop feeding the state machine (``service.py``), the
effect handlers (``dispatcher.py``, ``outbox.py``, ``finish.py``, ``control.py``), the take-in
(``intake.py``), the leader lease (``lease.py``, ``succession.py``) and vTime in Redis
(``vtime_store.py``)."""
