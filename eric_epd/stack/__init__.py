"""The local EPD stack on one host: server subprocess launchers and `eric-epd up`."""
