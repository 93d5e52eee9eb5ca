// Redoc on /redoc: the OpenAPI document of this server (its URL is the page's data-openapi). Redoc
// styles itself with <style> elements (styled-components): they carry the page's style nonce, the one
// style source the CSP allows besides this server's files.
"use strict";
Redoc.init(document.body.dataset.openapi, {nonce: document.body.dataset.styleNonce},
           document.getElementById("redoc"));
