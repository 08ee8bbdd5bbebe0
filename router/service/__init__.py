"""The router service (``kvrouter serve``): one HTTP server in front of model replicas.

:mod:`router.service.app` wires the process (``create_app``, ``start``, ``run``; the process
diagram is in docs/architecture.md): the HTTP server (:mod:`~router.service.fast_server`,
its connections :mod:`~router.service.http_connection`), the front door
(:mod:`~router.service.handling`, with the gate of :mod:`~router.service.security`, its
body checks :mod:`~router.service.intake` and request ids
:mod:`~router.service.request_identity`), the routing state (:mod:`~router.service.state`)
over the fleet (:mod:`~router.service.fleet`), the proxy (:mod:`~router.service.proxy`),
the route table of the other paths (:mod:`~router.service.public`,
:mod:`~router.service.admin`) and the worker group (:mod:`~router.service.workers`,
:mod:`~router.service.control`).
"""
