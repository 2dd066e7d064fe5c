"""Scale-out: ``tartlet serve --replicas N`` on Ray Serve (gateway, router,
replicas). Imported only on that path: the single-process server never
imports Ray."""
