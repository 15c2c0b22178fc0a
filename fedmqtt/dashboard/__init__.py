"""`fedmqtt dashboard`: a read-only web page that watches a federation (live, as the observer) or finished runs."""
