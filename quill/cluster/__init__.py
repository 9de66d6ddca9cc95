"""quill replicas on Ray Serve (the `quill[ray]` extra).

Only `deployments`, `ray_router` and `serve_cmd` import Ray; `routing`, `bridge` and `metrics` are
plain Python, so the routing policy and the request bridge are tested without a cluster. The
single-process server (quill.server) never imports this package.
"""
