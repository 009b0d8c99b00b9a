"""The model and its memory: config, the params/cache spec, the transformer, the KV-cache pytree, head
layouts, mesh sharding and the pinned-host KV store."""
