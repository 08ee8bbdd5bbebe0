"""Shared index storage: one interface (``base.IndexStore``), an in-memory and a Redis
implementation, the publisher-side ``StoreWriter`` and the router-side ``IndexSync``."""
