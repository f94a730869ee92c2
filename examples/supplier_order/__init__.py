"""The reference example, end to end: an agent orders from a supplier, and nothing is lost
or done twice when any process crashes.

Processes (each a separate OS process; :mod:`examples.supplier_order.pipeline` starts them):

* ``agent``      claims queued supplier-order runs, decides, and commits "waiting" plus an
                 ``order.submit`` message in ONE transaction (:mod:`.agent`);
* ``relay``      ``python -m relay``: publishes the committed messages to Kafka;
* ``consumer``   ``python -m consumers examples.supplier_order.consumer:app``: calls the
                 supplier through the operations ledger (``perform``) with an idempotency
                 key, and moves the run to ``done`` / ``failed`` with the evidence;
* ``reconciler`` asks the supplier about orders whose outcome we did not see (:mod:`.reconciler`);
* ``supplier``   ``examples/supplier.py``: a real HTTP server that can time out after
                 applying, refuse, or have its status endpoint down.

:mod:`.invariants` checks the promises from the database, the Kafka topic and the
supplier's own record. The demo (``examples/demo.py``) and the fault harness
(``tests/faults``) are built on these pieces.
"""
