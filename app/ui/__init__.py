"""The web dashboard served at /ui: static HTML, CSS and JavaScript shipped inside this package
(`app/ui/static/`), no build step, no third-party script and nothing fetched from the network.
The router is `app.ui.router.router`."""
