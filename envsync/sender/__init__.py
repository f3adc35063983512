"""The main process's side: what the sender desires and publishes (its records: core,
mirror, history, books, fleet), how a push is built, written and waited for, and how state
is read back and checkpointed. :class:`~envsync.sender.sender.Sender` is its front."""
