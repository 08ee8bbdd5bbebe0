"""The router service: an aiohttp app in front of model replicas (``kvrouter serve``).

``create_app(settings)`` in :mod:`router.service.app` builds it; configuration lives in
:mod:`router.service.config`, proxying in :mod:`router.service.proxy`, metrics in
:mod:`router.service.metrics`, admin endpoints in :mod:`router.service.admin`.
"""
