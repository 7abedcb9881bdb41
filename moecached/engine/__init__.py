"""One model's cache: the arena of slots, the O_DIRECT readers, the expert index, the eviction
policies, traces and the cache facade (acquire / prefetch / release). Imports only the facts."""
