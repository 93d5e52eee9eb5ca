// Swagger UI on /docs: the OpenAPI document of this server (its URL is the page's data-openapi), no
// validator badge (Swagger's default asks validator.swagger.io about every document it shows).
"use strict";
window.ui = SwaggerUIBundle({
  url: document.body.dataset.openapi,
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
