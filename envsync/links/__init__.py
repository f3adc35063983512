"""How bytes move between the sender and the workers: one interface (:mod:`.base`), a
shared-memory link for worker processes and an in-process link for a single-process
collector and for unit tests. Both lay out the same slots (:mod:`.slots`)."""
