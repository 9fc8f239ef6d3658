"""Scale-out deployment of the tokenmill server (Ray Serve: `tokenmill serve-ray`).

Ray is an optional dependency (`pip install 'tokenmill[ray]'`); nothing here imports it until used.
"""
