{{/* The release's resource names: <release>-relay, unless the release is named relay. */}}
{{- define "relay.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Fixed for the release's life: a Deployment's selector cannot change on
upgrade, so the role is a label beside it, not part of it. */}}
{{- define "relay.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: relay
{{- end -}}

{{- define "relay.labels" -}}
{{ include "relay.selectorLabels" . }}
relay.dev/role: {{ .Values.role }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "relay.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "relay.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The migrate hook's service account: the release's own is created
only after pre-install hooks, so the hook brings a copy. */}}
{{- define "relay.migrateServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- printf "%s-migrate" (include "relay.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "relay.configMapName" -}}
{{- .Values.existingConfigMap | default (printf "%s-config" (include "relay.fullname" .)) -}}
{{- end -}}

{{/* The environment every relay container gets: the database, the admin
token, the admin listener, and the user's variables. */}}
{{- define "relay.env" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.existingSecret: name the Secret holding DATABASE_URL (kubectl create secret generic relay-db --from-literal=DATABASE_URL=postgres://…)" .Values.database.existingSecret }}
      key: {{ .Values.database.key }}
{{- with .Values.adminToken.existingSecret }}
- name: RELAY_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.adminToken.key }}
{{- end }}
- name: RELAY_ADMIN__LISTEN
  value: "0.0.0.0:{{ .Values.admin.port }}"
{{- range .Values.secretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .key }}
{{- end }}
{{- range $name, $value := .Values.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* Nothing written to the filesystem, no capability, not root (the image's user 10001). */}}
{{- define "relay.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
