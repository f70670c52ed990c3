"""Media the gateway and Eric both fetch: the URL policy, the limits and the policy-checked fetcher."""
